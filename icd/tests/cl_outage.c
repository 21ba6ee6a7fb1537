/* A plain OpenCL program that computes, then waits (for a line on stdin:
 * the test takes the pool away meanwhile), then computes again and prints
 * what every call answered, and what its context's notification said. */
#include <CL/cl.h>
#include "first_device.h"
#include <stdio.h>
#include <string.h>

static void CL_CALLBACK notify(const char *what, const void *info, size_t size, void *data) {
    (void)info, (void)size, (void)data;
    printf("notified: %s\n", strstr(what, "session on the pool ended") != NULL ? "the session ended" : what);
    fflush(stdout);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    cl_platform_id platform;
    cl_device_id dev;
    cl_int err;
    if (first_device(&platform, &dev) != 0)
        return 2;
    cl_context ctx = clCreateContext(NULL, 1, &dev, notify, NULL, &err);
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    int data[1024] = {0}, back[1024];
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof data, data, &err);
    printf("before: %d\n", clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof back, back, 0, NULL, NULL));
    printf("ready\n");
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL)
        return 3;
    cl_event ev;
    printf("write: %d\n", clEnqueueWriteBuffer(q, b, CL_FALSE, 0, sizeof data, data, 0, NULL, &ev));
    printf("finish: %d\n", clFinish(q));
    cl_int status;
    clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL);
    printf("its event: %s\n", status < 0 ? "failed" : "not failed");
    printf("read after: %d\n", clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof back, back, 0, NULL, NULL));
    clReleaseEvent(ev);
    clReleaseMemObject(b);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("done\n");
    return 0;
}

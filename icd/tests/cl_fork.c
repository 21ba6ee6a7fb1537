/* A plain OpenCL program that forks: a second copy of its session (issue
 * 30, as a restored snapshot of the guest would hold one).
 *
 *   1. it bumps a counter buffer (a kernel that adds 1 to each element)
 *      FIRST times, then clFinish;
 *   2. it forks twice: the first child only lets its copies of the
 *      objects go and exits (nothing of that may reach the pool); the
 *      second waits until the parent has moved on, then launches and
 *      finishes on its copy of the context, and says what it got;
 *   3. the parent moves on (SECOND bumps, a finish, one more bump and a
 *      finish: its acknowledgements now pass what the copy saw), lets the
 *      second child go, waits for both, bumps THIRD more times and reads
 *      the counter back.
 *
 * It prints each process's outcome; the counter must be exactly the
 * parent's bumps: nothing the children did ran. */
#include <CL/cl.h>
#include "first_device.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define N 1024
#define FIRST 5
#define SECOND 7
#define THIRD 3

static const char *SOURCE = "kernel void bump(global int *x) { x[get_global_id(0)] += 1; }";

static cl_int bump(cl_command_queue q, cl_kernel k, int times) {
    size_t global = N;
    cl_int err = CL_SUCCESS;
    for (int i = 0; i < times && err == CL_SUCCESS; i++)
        err = clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, NULL);
    cl_int finished = clFinish(q);
    return err != CL_SUCCESS ? err : finished;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    cl_platform_id platform;
    cl_device_id dev;
    cl_int err;
    if (first_device(&platform, &dev) != 0)
        return 2;
    cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    static int counts[N];
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof counts, counts, &err);
    cl_program p = clCreateProgramWithSource(ctx, 1, &SOURCE, NULL, &err);
    clBuildProgram(p, 1, &dev, "", NULL, NULL);
    cl_kernel k = clCreateKernel(p, "bump", &err);
    clSetKernelArg(k, 0, sizeof b, &b);
    printf("parent before: %d\n", bump(q, k, FIRST));

    pid_t letting_go = fork();
    if (letting_go == 0) {
        clReleaseKernel(k);
        clReleaseProgram(p);
        clReleaseMemObject(b);
        clReleaseCommandQueue(q);
        clReleaseContext(ctx);
        printf("first child: let everything go\n");
        exit(0);
    }
    int go[2];
    if (pipe(go) != 0)
        return 2;
    pid_t copy = fork();
    if (copy == 0) {
        close(go[1]);
        char c;
        if (read(go[0], &c, 1) != 1)
            _exit(3);
        cl_int launched = bump(q, k, 1);
        int back[N];
        cl_int read_back = clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof back, back, 0, NULL, NULL);
        printf("second child: bump %d, read %d\n", launched, read_back);
        clReleaseContext(ctx);
        exit(0);
    }
    close(go[0]);
    cl_int moved = bump(q, k, SECOND);
    cl_int again = bump(q, k, 1); /* (its launch acknowledges every reply before it) */
    printf("parent moved on: %d %d\n", moved, again);
    if (write(go[1], "m", 1) != 1)
        return 2;
    close(go[1]);
    int status;
    waitpid(letting_go, &status, 0);
    printf("first child exited: %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    waitpid(copy, &status, 0);
    printf("second child exited: %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    printf("parent after: %d\n", bump(q, k, THIRD));
    cl_int read = clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof counts, counts, 0, NULL, NULL);
    int same = 1;
    for (int i = 1; i < N; i++)
        same &= counts[i] == counts[0];
    printf("counter: %d %s (read %d, expected %d)\n", counts[0], same ? "everywhere" : "NOT EVERYWHERE", read,
           FIRST + SECOND + 1 + THIRD);
    clReleaseKernel(k);
    clReleaseProgram(p);
    clReleaseMemObject(b);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("done\n");
    return 0;
}

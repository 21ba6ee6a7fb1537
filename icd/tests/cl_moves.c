/* A plain OpenCL solver that keeps its state in device memory, driven by
 * lines on stdin, so that a test can move its session (a migration's
 * rehome, a cut, a redirect) between the steps and compare what it prints
 * with the same run on local PoCL, byte for byte:
 *
 *   step N   N more relaxation sweeps (each a launch with local memory and
 *            scalar arguments, ping-ponging two buffers), then clFinish;
 *            prints "step: <sweeps so far> <status>"
 *   sum      reads the state back; prints "sum: <FNV-1a of its bytes> <status>"
 *   quit     releases everything; prints "done"
 *
 * After the context is made it prints "ready".  Every OpenCL status is
 * printed as the call answered it (a failed step says so, it does not end
 * the program). */
#include <CL/cl.h>
#include "first_device.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N (1 << 16)
#define LOCAL 64

static const char *SOURCE =
    "__kernel void relax(__global const float *in, __global float *out, __local float *tile,\n"
    "                    float k, uint n) {\n"
    "    size_t i = get_global_id(0), l = get_local_id(0);\n"
    "    tile[l] = in[i];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    float left = i > 0 ? in[i - 1] : tile[l];\n"
    "    float right = i + 1 < n ? in[i + 1] : tile[l];\n"
    "    out[i] = tile[l] + k * (left - 2.0f * tile[l] + right) + 0.001f * sin((float)(i % 97));\n"
    "}\n";

static uint64_t fnv1a(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    cl_platform_id platform;
    cl_device_id dev;
    cl_int err;
    if (first_device(&platform, &dev) != 0)
        return 2;
    cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    if (ctx == NULL) {
        printf("no context: %d\n", err);
        return 2;
    }
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    float *init = malloc(N * sizeof *init);
    for (int i = 0; i < N; i++)
        init[i] = (float)((i * 7919) % 1000) / 10.0f;
    cl_mem a = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, N * sizeof(float), init, &err);
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, N * sizeof(float), NULL, &err);
    cl_program prog = clCreateProgramWithSource(ctx, 1, &SOURCE, NULL, &err);
    err = clBuildProgram(prog, 1, &dev, "", NULL, NULL);
    cl_kernel kernel = clCreateKernel(prog, "relax", &err);
    if (kernel == NULL) {
        printf("no kernel: %d\n", err);
        return 2;
    }
    float k = 0.23f;
    cl_uint n = N;
    clSetKernelArg(kernel, 2, LOCAL * sizeof(float), NULL);
    clSetKernelArg(kernel, 3, sizeof k, &k);
    clSetKernelArg(kernel, 4, sizeof n, &n);
    printf("ready\n");
    long sweeps = 0;
    char line[64];
    float *back = malloc(N * sizeof *back);
    while (fgets(line, sizeof line, stdin) != NULL) {
        long count = 0;
        if (sscanf(line, "step %ld", &count) == 1) {
            cl_int status = CL_SUCCESS;
            size_t global = N, local = LOCAL;
            for (long i = 0; i < count && status == CL_SUCCESS; i++, sweeps++) {
                cl_mem from = sweeps % 2 == 0 ? a : b, to = sweeps % 2 == 0 ? b : a;
                clSetKernelArg(kernel, 0, sizeof from, &from);
                clSetKernelArg(kernel, 1, sizeof to, &to);
                status = clEnqueueNDRangeKernel(q, kernel, 1, NULL, &global, &local, 0, NULL, NULL);
            }
            cl_int finished = clFinish(q);
            printf("step: %ld %d %d\n", sweeps, status, finished);
        } else if (strncmp(line, "sum", 3) == 0) {
            cl_mem state = sweeps % 2 == 0 ? a : b;
            memset(back, 0, N * sizeof *back);
            cl_int status = clEnqueueReadBuffer(q, state, CL_TRUE, 0, N * sizeof(float), back, 0, NULL, NULL);
            printf("sum: %016llx %d\n", (unsigned long long)fnv1a(back, N * sizeof(float)), status);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    clReleaseKernel(kernel);
    clReleaseProgram(prog);
    clReleaseMemObject(a);
    clReleaseMemObject(b);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    free(init);
    free(back);
    printf("done\n");
    return 0;
}

/* A plain OpenCL C program (the Khronos loader, the first platform's first
 * device): it computes and queries what applications do and prints what
 * it got, one line per check, nothing that depends on timing or addresses.
 * tests/icd runs it on local PoCL and on the accelmig driver and compares
 * the two outputs byte for byte.
 *
 * It is ours, written against the OpenCL API only (no accelmig header). */
#include <CL/cl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static cl_context ctx;
static cl_device_id dev;
static cl_command_queue q;
static int failures;

#define CHECK(call)                                                                                             \
    do {                                                                                                        \
        cl_int err_ = (call);                                                                                   \
        if (err_ != CL_SUCCESS) {                                                                               \
            printf("FAILED %s:%d: %s -> %d\n", __FILE__, __LINE__, #call, err_);                                \
            failures++;                                                                                         \
        }                                                                                                       \
    } while (0)

static uint64_t digest(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static uint32_t lcg(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state;
}

static const char *SOURCE =
    "typedef struct { int a; float b; char c[8]; } pair_t;\n"
    "kernel void saxpy(global float *y, global const float *x, float a, uint n) {\n"
    "  size_t i = get_global_id(0); if (i < n) y[i] = a * x[i] + y[i]; }\n"
    "kernel void group_sums(global const int *in, local int *scratch, global int *out) {\n"
    "  size_t l = get_local_id(0), n = get_local_size(0);\n"
    "  scratch[l] = in[get_global_id(0)]; barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (size_t s = n / 2; s > 0; s /= 2) { if (l < s) scratch[l] += scratch[l + s]; barrier(CLK_LOCAL_MEM_FENCE); }\n"
    "  if (l == 0) out[get_group_id(0)] = scratch[0]; }\n"
    "kernel void trig(global double *out) { size_t i = get_global_id(0); double x = (double)i * 0.001;\n"
    "  out[i] = sin(x) * cos(3.0 * x) + exp(-x) + sqrt(x + 1.0); }\n"
    "kernel void by_value(global float *out, pair_t p, float4 v, global int *maybe) {\n"
    "  out[0] = p.a + p.b + p.c[7]; out[1] = v.x + v.y * 2 + v.z * 3 + v.w * 4; out[2] = maybe ? 1.0f : -1.0f; }\n"
    "kernel void bump(global int *x, int by) { x[get_global_id(0)] += by; }\n"
    "__attribute__((reqd_work_group_size(8, 1, 1)))\n"
    "kernel void fixed(global int *x) { x[get_global_id(0)] *= 2; }\n"
    "kernel void matrix(global float *c, global const float *a, global const float *b, int n) {\n"
    "  int i = get_global_id(0), j = get_global_id(1); float s = 0;\n"
    "  for (int k = 0; k < n; k++) s += a[i * n + k] * b[k * n + j]; c[i * n + j] = s; }\n";

static cl_program build(const char *source, const char *options) {
    cl_int err;
    cl_program program = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
    CHECK(err);
    CHECK(clBuildProgram(program, 1, &dev, options, NULL, NULL));
    return program;
}

static cl_kernel kernel(cl_program program, const char *name) {
    cl_int err;
    cl_kernel k = clCreateKernel(program, name, &err);
    CHECK(err);
    return k;
}

static cl_mem buffer(cl_mem_flags flags, size_t size, void *host) {
    cl_int err;
    cl_mem mem = clCreateBuffer(ctx, flags, size, host, &err);
    CHECK(err);
    return mem;
}

static void check_saxpy(cl_program program) {
    enum { N = 100003 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    uint32_t seed = 7;
    for (int i = 0; i < N; i++) {
        x[i] = (float)(lcg(&seed) % 10000) / 100.0f;
        y[i] = (float)(lcg(&seed) % 10000) / 1000.0f;
    }
    cl_mem bx = buffer(CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, N * sizeof *x, x);
    cl_mem by = buffer(CL_MEM_READ_WRITE, N * sizeof *y, NULL);
    CHECK(clEnqueueWriteBuffer(q, by, CL_TRUE, 0, N * sizeof *y, y, 0, NULL, NULL));
    cl_kernel k = kernel(program, "saxpy");
    float a = 2.5f;
    cl_uint n = N;
    CHECK(clSetKernelArg(k, 0, sizeof by, &by));
    CHECK(clSetKernelArg(k, 1, sizeof bx, &bx));
    CHECK(clSetKernelArg(k, 2, sizeof a, &a));
    CHECK(clSetKernelArg(k, 3, sizeof n, &n));
    size_t global = N;
    for (int round = 0; round < 20; round++)
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, by, CL_TRUE, 0, N * sizeof *y, y, 0, NULL, NULL));
    printf("saxpy: %016llx\n", (unsigned long long)digest(y, N * sizeof *y));
    clReleaseKernel(k);
    clReleaseMemObject(bx);
    clReleaseMemObject(by);
    free(x);
    free(y);
}

static void check_local_memory(cl_program program) {
    enum { N = 65536, LOCAL = 64 };
    int *in = malloc(N * sizeof *in), out[N / LOCAL];
    uint32_t seed = 11;
    for (int i = 0; i < N; i++)
        in[i] = (int)(lcg(&seed) % 2001) - 1000;
    cl_mem bin = buffer(CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, N * sizeof *in, in);
    cl_mem bout = buffer(CL_MEM_WRITE_ONLY, sizeof out, NULL);
    cl_kernel k = kernel(program, "group_sums");
    CHECK(clSetKernelArg(k, 0, sizeof bin, &bin));
    CHECK(clSetKernelArg(k, 1, LOCAL * sizeof(int), NULL));
    CHECK(clSetKernelArg(k, 2, sizeof bout, &bout));
    size_t global = N, local = LOCAL;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, &local, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, bout, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL));
    long total = 0;
    for (int i = 0; i < N / LOCAL; i++)
        total += out[i];
    printf("local memory: %016llx total %ld\n", (unsigned long long)digest(out, sizeof out), total);
    size_t bad_local = 48;
    printf("local size not dividing: %d\n", clEnqueueNDRangeKernel(q, k, 1, NULL, &global, &bad_local, 0, NULL, NULL));
    clReleaseKernel(k);
    clReleaseMemObject(bin);
    clReleaseMemObject(bout);
    free(in);
}

static void check_doubles_and_values(cl_program program) {
    enum { N = 4096 };
    double *out = malloc(N * sizeof *out);
    cl_mem b = buffer(CL_MEM_WRITE_ONLY, N * sizeof *out, NULL);
    cl_kernel k = kernel(program, "trig");
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    size_t global = N;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, N * sizeof *out, out, 0, NULL, NULL));
    printf("doubles: %016llx\n", (unsigned long long)digest(out, N * sizeof *out));
    free(out);
    clReleaseKernel(k);
    clReleaseMemObject(b);

    struct { cl_int a; cl_float b; char c[8]; } pair = {42, 0.5f, {1, 2, 3, 4, 5, 6, 7, 9}};
    cl_float4 v = {{1.0f, 2.0f, 3.0f, 4.0f}};
    float result[3];
    cl_mem r = buffer(CL_MEM_WRITE_ONLY, sizeof result, NULL);
    cl_mem none = NULL;
    k = kernel(program, "by_value");
    CHECK(clSetKernelArg(k, 0, sizeof r, &r));
    CHECK(clSetKernelArg(k, 1, sizeof pair, &pair));
    CHECK(clSetKernelArg(k, 2, sizeof v, &v));
    CHECK(clSetKernelArg(k, 3, sizeof none, &none));
    size_t one = 1;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &one, &one, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, r, CL_TRUE, 0, sizeof result, result, 0, NULL, NULL));
    printf("by value: %g %g %g\n", result[0], result[1], result[2]);
    clReleaseKernel(k);
    clReleaseMemObject(r);
}

static void check_fill_rect_copy(void) {
    enum { W = 64, H = 32, D = 4 };
    size_t size = W * H * D;
    unsigned char *host = calloc(1, size), *back = calloc(1, size);
    cl_mem a = buffer(CL_MEM_READ_WRITE, size, NULL), b = buffer(CL_MEM_READ_WRITE, size, NULL);
    cl_uint pattern = 0xa1b2c3d4u, zero = 0;
    CHECK(clEnqueueFillBuffer(q, a, &zero, sizeof zero, 0, size, 0, NULL, NULL));
    CHECK(clEnqueueFillBuffer(q, a, &pattern, sizeof pattern, 64, size - 128, 0, NULL, NULL));
    unsigned char small = 0x5a;
    CHECK(clEnqueueFillBuffer(q, b, &small, 1, 0, size, 0, NULL, NULL));
    for (size_t i = 0; i < size; i++)
        host[i] = (unsigned char)(i * 7 + 3);
    size_t buffer_origin[3] = {5, 3, 1}, host_origin[3] = {2, 1, 0}, region[3] = {17, 9, 2};
    CHECK(clEnqueueWriteBufferRect(q, a, CL_TRUE, buffer_origin, host_origin, region, W, W * H, 40, 40 * 20, host,
                                   0, NULL, NULL));
    size_t src_origin[3] = {4, 2, 1}, dst_origin[3] = {10, 5, 0}, copy_region[3] = {20, 10, 3};
    CHECK(clEnqueueCopyBufferRect(q, a, b, src_origin, dst_origin, copy_region, W, W * H, W, W * H, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, a, CL_TRUE, 0, size, back, 0, NULL, NULL));
    printf("fill + write rect: %016llx\n", (unsigned long long)digest(back, size));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, size, back, 0, NULL, NULL));
    printf("copy rect: %016llx\n", (unsigned long long)digest(back, size));
    memset(back, 0, size);
    size_t read_origin[3] = {1, 1, 0}, read_region[3] = {30, 12, 2};
    CHECK(clEnqueueReadBufferRect(q, b, CL_TRUE, dst_origin, read_origin, read_region, W, W * H, 33, 33 * 14, back,
                                  0, NULL, NULL));
    printf("read rect: %016llx\n", (unsigned long long)digest(back, 33 * 14 * 2));
    CHECK(clEnqueueCopyBuffer(q, a, b, 100, 1000, 3000, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, size, back, 0, NULL, NULL));
    printf("copy: %016llx\n", (unsigned long long)digest(back, size));
    printf("copy overlap: %d\n", clEnqueueCopyBuffer(q, a, a, 0, 10, 100, 0, NULL, NULL));
    printf("read past the end: %d\n", clEnqueueReadBuffer(q, a, CL_TRUE, size - 4, 8, back, 0, NULL, NULL));
    printf("fill pattern of 3: %d\n", clEnqueueFillBuffer(q, a, &pattern, 3, 0, 12, 0, NULL, NULL));
    clReleaseMemObject(a);
    clReleaseMemObject(b);
    free(host);
    free(back);
}

static void check_sub_buffers_and_maps(cl_program program) {
    cl_uint align_bits;
    CHECK(clGetDeviceInfo(dev, CL_DEVICE_MEM_BASE_ADDR_ALIGN, sizeof align_bits, &align_bits, NULL));
    size_t align = align_bits / 8, size = 16 * align;
    int *host = malloc(size);
    for (size_t i = 0; i < size / sizeof *host; i++)
        host[i] = (int)i;
    cl_mem parent = buffer(CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, size, host);
    cl_int err;
    cl_buffer_region region = {2 * align, 4 * align};
    cl_mem sub = clCreateSubBuffer(parent, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &region, &err);
    CHECK(err);
    cl_buffer_region misaligned = {align / 2 ? align / 2 : 1, align};
    cl_mem bad = clCreateSubBuffer(parent, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &misaligned, &err);
    printf("misaligned sub-buffer: %d %s\n", err, bad == NULL ? "null" : "made");
    cl_kernel k = kernel(program, "bump");
    int by = 1000;
    CHECK(clSetKernelArg(k, 0, sizeof sub, &sub));
    CHECK(clSetKernelArg(k, 1, sizeof by, &by));
    size_t global = region.size / sizeof(int);
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, NULL));
    int *mapped = clEnqueueMapBuffer(q, parent, CL_TRUE, CL_MAP_READ, 0, size, 0, NULL, NULL, &err);
    CHECK(err);
    printf("map of a use-host-ptr buffer is its memory: %s\n", mapped == host ? "yes" : "no");
    printf("sub-buffer through the parent: %016llx\n", (unsigned long long)digest(mapped, size));
    CHECK(clEnqueueUnmapMemObject(q, parent, mapped, 0, NULL, NULL));
    /* a map for writing of an ordinary buffer, then a kernel, then a read map */
    cl_mem plain = buffer(CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, 4096, NULL);
    int *w = clEnqueueMapBuffer(q, plain, CL_TRUE, CL_MAP_WRITE_INVALIDATE_REGION, 0, 4096, 0, NULL, NULL, &err);
    CHECK(err);
    for (int i = 0; i < 1024; i++)
        w[i] = i * i;
    cl_event unmapped;
    CHECK(clEnqueueUnmapMemObject(q, plain, w, 0, NULL, &unmapped));
    CHECK(clSetKernelArg(k, 0, sizeof plain, &plain));
    global = 1024;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 1, &unmapped, NULL));
    int *r = clEnqueueMapBuffer(q, plain, CL_TRUE, CL_MAP_READ, 64, 1024, 0, NULL, NULL, &err);
    CHECK(err);
    printf("map round trip: %016llx\n", (unsigned long long)digest(r, 1024));
    cl_uint count;
    CHECK(clGetMemObjectInfo(plain, CL_MEM_MAP_COUNT, sizeof count, &count, NULL));
    printf("map count: %u\n", count);
    CHECK(clEnqueueUnmapMemObject(q, plain, r, 0, NULL, NULL));
    CHECK(clFinish(q));
    size_t offset;
    cl_mem associated;
    CHECK(clGetMemObjectInfo(sub, CL_MEM_OFFSET, sizeof offset, &offset, NULL));
    CHECK(clGetMemObjectInfo(sub, CL_MEM_ASSOCIATED_MEMOBJECT, sizeof associated, &associated, NULL));
    printf("sub-buffer info: offset %zu/align, parent %s\n", offset / align, associated == parent ? "yes" : "no");
    clReleaseEvent(unmapped);
    clReleaseKernel(k);
    clReleaseMemObject(sub);
    clReleaseMemObject(parent);
    clReleaseMemObject(plain);
    free(host);
}

static atomic_int callbacks;

static void CL_CALLBACK on_complete(cl_event event, cl_int status, void *data) {
    (void)event;
    if (status == CL_COMPLETE && data == &callbacks)
        atomic_fetch_add(&callbacks, 1);
}

static void check_events(cl_program program) {
    cl_int err;
    int values[256];
    for (int i = 0; i < 256; i++)
        values[i] = i;
    cl_mem b = buffer(CL_MEM_READ_WRITE, sizeof values, NULL);
    cl_event gate = clCreateUserEvent(ctx, &err);
    CHECK(err);
    cl_event written, ran, marker;
    CHECK(clEnqueueWriteBuffer(q, b, CL_FALSE, 0, sizeof values, values, 1, &gate, &written));
    cl_kernel k = kernel(program, "bump");
    int by = 5;
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    CHECK(clSetKernelArg(k, 1, sizeof by, &by));
    size_t global = 256;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, &ran));
    CHECK(clSetEventCallback(ran, CL_COMPLETE, on_complete, &callbacks));
    CHECK(clEnqueueMarkerWithWaitList(q, 0, NULL, &marker));
    cl_int status;
    CHECK(clGetEventInfo(written, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL));
    printf("held behind a user event: %s\n", status > CL_SUBMITTED ? "queued" : "not held");
    CHECK(clSetUserEventStatus(gate, CL_COMPLETE));
    printf("user event set twice: %d\n", clSetUserEventStatus(gate, CL_COMPLETE));
    CHECK(clWaitForEvents(1, &marker));
    CHECK(clGetEventInfo(ran, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL));
    printf("kernel after the marker: %d\n", status);
    int out[256];
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL));
    printf("gated write and kernel: %016llx\n", (unsigned long long)digest(out, sizeof out));
    cl_command_type type;
    CHECK(clGetEventInfo(ran, CL_EVENT_COMMAND_TYPE, sizeof type, &type, NULL));
    printf("event type: %#x\n", type);

    /* a failed user event fails what waits for it */
    cl_event doomed = clCreateUserEvent(ctx, &err);
    cl_event never;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 1, &doomed, &never));
    CHECK(clSetUserEventStatus(doomed, -1234));
    printf("waiting on a failed event: %d\n", clWaitForEvents(1, &never));
    CHECK(clGetEventInfo(never, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL));
    printf("its status: %s\n", status < 0 ? "failed" : "not failed");
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL));
    printf("nothing ran: %016llx\n", (unsigned long long)digest(out, sizeof out));

    /* a second queue, waiting on the first one's command */
    cl_command_queue q2 = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    CHECK(err);
    cl_event first;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, &first));
    CHECK(clEnqueueNDRangeKernel(q2, k, 1, NULL, &global, NULL, 1, &first, NULL));
    CHECK(clFinish(q2));
    CHECK(clEnqueueReadBuffer(q2, b, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL));
    printf("two queues: %016llx\n", (unsigned long long)digest(out, sizeof out));
    CHECK(clFinish(q));
    for (int i = 0; i < 100 && atomic_load(&callbacks) == 0; i++) {
        struct timespec pause = {0, 10 * 1000 * 1000};
        nanosleep(&pause, NULL); /* (callbacks run on a thread of their own: let it) */
    }
    printf("completion callbacks: %d\n", atomic_load(&callbacks));
    clReleaseEvent(first);
    clReleaseEvent(never);
    clReleaseEvent(doomed);
    clReleaseEvent(gate);
    clReleaseEvent(written);
    clReleaseEvent(ran);
    clReleaseEvent(marker);
    clReleaseCommandQueue(q2);
    clReleaseKernel(k);
    clReleaseMemObject(b);
}

static void check_profiling(cl_program program) {
    cl_int err;
    cl_queue_properties props[] = {CL_QUEUE_PROPERTIES, CL_QUEUE_PROFILING_ENABLE, 0};
    cl_command_queue pq = clCreateCommandQueueWithProperties(ctx, dev, props, &err);
    CHECK(err);
    cl_mem b = buffer(CL_MEM_READ_WRITE, 1 << 20, NULL);
    cl_kernel k = kernel(program, "bump");
    int by = 1;
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    CHECK(clSetKernelArg(k, 1, sizeof by, &by));
    size_t global = (1 << 20) / sizeof(int);
    cl_event ev;
    CHECK(clEnqueueNDRangeKernel(pq, k, 1, NULL, &global, NULL, 0, NULL, &ev));
    CHECK(clWaitForEvents(1, &ev));
    cl_ulong t[4];
    cl_profiling_info names[4] = {CL_PROFILING_COMMAND_QUEUED, CL_PROFILING_COMMAND_SUBMIT,
                                  CL_PROFILING_COMMAND_START, CL_PROFILING_COMMAND_END};
    for (int i = 0; i < 4; i++)
        CHECK(clGetEventProfilingInfo(ev, names[i], sizeof t[i], &t[i], NULL));
    printf("profiling times in order: %s\n", t[0] <= t[1] && t[1] <= t[2] && t[2] <= t[3] && t[3] > 0 ? "yes" : "no");
    cl_event plain;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, &plain));
    CHECK(clWaitForEvents(1, &plain));
    printf("no profiling on a plain queue: %d\n",
           clGetEventProfilingInfo(plain, CL_PROFILING_COMMAND_END, sizeof t[0], &t[0], NULL));
    clReleaseEvent(ev);
    clReleaseEvent(plain);
    clReleaseKernel(k);
    clReleaseMemObject(b);
    clReleaseCommandQueue(pq);
}

static void check_programs(void) {
    cl_int err;
    const char *broken = "kernel void broken(global int *x) { x[0] = undeclared; }";
    cl_program bad = clCreateProgramWithSource(ctx, 1, &broken, NULL, &err);
    CHECK(err);
    printf("build of a broken program: %d\n", clBuildProgram(bad, 1, &dev, "", NULL, NULL));
    size_t log_size;
    CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &log_size));
    char *log = malloc(log_size);
    CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_LOG, log_size, log, NULL));
    printf("its log names the mistake: %s\n", strstr(log, "undeclared") != NULL ? "yes" : "no");
    cl_build_status status;
    CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_STATUS, sizeof status, &status, NULL));
    printf("its status: %d\n", status);
    free(log);
    clReleaseProgram(bad);

    cl_program program = build(SOURCE, "-cl-kernel-arg-info -DUNUSED=1");
    char names[512];
    CHECK(clGetProgramInfo(program, CL_PROGRAM_KERNEL_NAMES, sizeof names, names, NULL));
    size_t count;
    CHECK(clGetProgramInfo(program, CL_PROGRAM_NUM_KERNELS, sizeof count, &count, NULL));
    printf("kernels: %zu\n", count);
    char options[128];
    CHECK(clGetProgramBuildInfo(program, dev, CL_PROGRAM_BUILD_OPTIONS, sizeof options, options, NULL));
    printf("options: %s\n", options);
    cl_kernel k = kernel(program, "by_value");
    cl_uint nargs;
    CHECK(clGetKernelInfo(k, CL_KERNEL_NUM_ARGS, sizeof nargs, &nargs, NULL));
    printf("by_value arguments: %u\n", nargs);
    for (cl_uint i = 0; i < nargs; i++) {
        char type[64], name[64];
        cl_kernel_arg_address_qualifier address;
        CHECK(clGetKernelArgInfo(k, i, CL_KERNEL_ARG_TYPE_NAME, sizeof type, type, NULL));
        CHECK(clGetKernelArgInfo(k, i, CL_KERNEL_ARG_NAME, sizeof name, name, NULL));
        CHECK(clGetKernelArgInfo(k, i, CL_KERNEL_ARG_ADDRESS_QUALIFIER, sizeof address, &address, NULL));
        printf("  %s %s (%#x)\n", type, name, address);
    }
    printf("argument index past the end: %d\n", clSetKernelArg(k, nargs, sizeof(int), &nargs));
    size_t one = 1;
    printf("launch with arguments unset: %d\n", clEnqueueNDRangeKernel(q, k, 1, NULL, &one, NULL, 0, NULL, NULL));
    cl_kernel fixed = kernel(program, "fixed");
    size_t compile[3], multiple;
    CHECK(clGetKernelWorkGroupInfo(fixed, dev, CL_KERNEL_COMPILE_WORK_GROUP_SIZE, sizeof compile, compile, NULL));
    CHECK(clGetKernelWorkGroupInfo(fixed, dev, CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE, sizeof multiple,
                                   &multiple, NULL));
    printf("required work-group size: %zu %zu %zu, multiple %zu\n", compile[0], compile[1], compile[2], multiple);
    cl_kernel none = clCreateKernel(program, "no_such_kernel", &err);
    printf("a kernel that is not there: %d %s\n", err, none == NULL ? "null" : "made");

    /* the binary, and a program built from it */
    size_t binary_size;
    CHECK(clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof binary_size, &binary_size, NULL));
    unsigned char *binary = malloc(binary_size);
    CHECK(clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof binary, &binary, NULL));
    const unsigned char *binaries[1] = {binary};
    cl_int binary_status;
    cl_program again = clCreateProgramWithBinary(ctx, 1, &dev, &binary_size, binaries, &binary_status, &err);
    CHECK(err);
    CHECK(clBuildProgram(again, 1, &dev, NULL, NULL, NULL));
    cl_kernel bump = kernel(again, "bump");
    int values[64] = {0};
    cl_mem b = buffer(CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof values, values);
    int by = 77;
    CHECK(clSetKernelArg(bump, 0, sizeof b, &b));
    CHECK(clSetKernelArg(bump, 1, sizeof by, &by));
    size_t global = 64;
    CHECK(clEnqueueNDRangeKernel(q, bump, 1, NULL, &global, NULL, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof values, values, 0, NULL, NULL));
    printf("a program from its binary: %d %d\n", values[0], values[63]);
    free(binary);
    clReleaseMemObject(b);
    clReleaseKernel(bump);
    clReleaseKernel(fixed);
    clReleaseKernel(k);
    clReleaseProgram(again);
    clReleaseProgram(program);
}

/* Headers of the application's: a file under -I (and one it includes
 * next to itself), and separate compilation: two units, one of them with
 * an input header and a macro of its own, linked into a program. */
static void check_headers_compile_and_link(void) {
    cl_int err;
    char dir[] = "/tmp/cl-checks-XXXXXX";
    if (mkdtemp(dir) == NULL) {
        printf("FAILED: no temporary directory\n");
        failures++;
        return;
    }
    char path[128], inner[128];
    snprintf(path, sizeof path, "%s/scale.h", dir);
    snprintf(inner, sizeof inner, "%s/factor.h", dir);
    FILE *f = fopen(path, "w"), *g = fopen(inner, "w");
    if (f == NULL || g == NULL) {
        printf("FAILED: cannot write the headers\n");
        failures++;
        return;
    }
    fputs("#pragma once\n#include \"factor.h\"\ninline int scaled(int x) { return x * FACTOR; }\n", f);
    fputs("#define FACTOR 3\n", g);
    fclose(f);
    fclose(g);
    const char *with_header = "#include <scale.h>\n#include \"scale.h\"\n"
                              "kernel void times(global int *x) { x[get_global_id(0)] = scaled(x[get_global_id(0)]); }";
    cl_program p = clCreateProgramWithSource(ctx, 1, &with_header, NULL, &err);
    char options[160];
    snprintf(options, sizeof options, "-I %s", dir);
    printf("build with a header under -I: %d\n", clBuildProgram(p, 1, &dev, options, NULL, NULL));
    int values[16];
    for (int i = 0; i < 16; i++)
        values[i] = i;
    cl_mem b = buffer(CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof values, values);
    cl_kernel k = clCreateKernel(p, "times", &err);
    CHECK(err);
    size_t global = 16;
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &global, NULL, 0, NULL, NULL));
    const char *missing = "#include \"not-there.h\"\nkernel void k(global int *x) { }";
    cl_program absent = clCreateProgramWithSource(ctx, 1, &missing, NULL, &err);
    printf("build with a header that is nowhere: %d\n", clBuildProgram(absent, 1, &dev, options, NULL, NULL));
    clReleaseProgram(absent);
    unlink(path);
    unlink(inner);
    rmdir(dir);

    const char *sink = "void add_to(global int *x, int by) { *x += by * OFFSET; }";
    const char *header = "inline int twice(int x) { return 2 * x; }";
    const char *main_unit = "#include \"twice.h\"\nvoid add_to(global int *x, int by);\n"
                            "kernel void linked(global int *x) { add_to(&x[get_global_id(0)], twice(OFFSET)); }";
    cl_program unit_a = clCreateProgramWithSource(ctx, 1, &sink, NULL, &err);
    cl_program unit_h = clCreateProgramWithSource(ctx, 1, &header, NULL, &err);
    cl_program unit_b = clCreateProgramWithSource(ctx, 1, &main_unit, NULL, &err);
    const char *names[1] = {"twice.h"};
    printf("compile: %d", clCompileProgram(unit_a, 1, &dev, "-DOFFSET=5", 0, NULL, NULL, NULL, NULL));
    printf(" %d\n", clCompileProgram(unit_b, 1, &dev, "-D OFFSET=1", 1, &unit_h, names, NULL, NULL));
    cl_program units[2] = {unit_a, unit_b};
    cl_program linked = clLinkProgram(ctx, 1, &dev, "", 2, units, NULL, NULL, &err);
    printf("link: %d\n", err);
    cl_program_binary_type type;
    CHECK(clGetProgramBuildInfo(unit_a, dev, CL_PROGRAM_BINARY_TYPE, sizeof type, &type, NULL));
    printf("a compiled unit's binary type: %#x\n", (unsigned)type);
    if (linked != NULL) {
        cl_kernel lk = clCreateKernel(linked, "linked", &err);
        CHECK(err);
        CHECK(clSetKernelArg(lk, 0, sizeof b, &b));
        CHECK(clEnqueueNDRangeKernel(q, lk, 1, NULL, &global, NULL, 0, NULL, NULL));
        clReleaseKernel(lk);
        clReleaseProgram(linked);
    }
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof values, values, 0, NULL, NULL));
    printf("headers, compile and link: %d %d %d\n", values[0], values[1], values[15]);
    clReleaseKernel(k);
    clReleaseProgram(p);
    clReleaseProgram(unit_a);
    clReleaseProgram(unit_h);
    clReleaseProgram(unit_b);
    clReleaseMemObject(b);
}

typedef struct worker {
    cl_program program;
    int id;
    uint64_t result;
} worker;

/* Threads of their own, each with its queue, into one context: OpenCL
 * objects are shared between threads. */
static void *work(void *arg) {
    worker *w = arg;
    cl_int err;
    cl_command_queue wq = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    enum { N = 64 };
    float a[N * N], b[N * N], c[N * N];
    uint32_t seed = (uint32_t)w->id + 100;
    for (int i = 0; i < N * N; i++) {
        a[i] = (float)(lcg(&seed) % 100) / 10.0f;
        b[i] = (float)(lcg(&seed) % 100) / 10.0f;
    }
    cl_mem ba = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof a, a, &err);
    cl_mem bb = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof b, b, &err);
    cl_mem bc = clCreateBuffer(ctx, CL_MEM_WRITE_ONLY, sizeof c, NULL, &err);
    cl_kernel k = clCreateKernel(w->program, "matrix", &err);
    int n = N;
    clSetKernelArg(k, 0, sizeof bc, &bc);
    clSetKernelArg(k, 1, sizeof ba, &ba);
    clSetKernelArg(k, 2, sizeof bb, &bb);
    clSetKernelArg(k, 3, sizeof n, &n);
    size_t global[2] = {N, N}, local[2] = {8, 8};
    err = clEnqueueNDRangeKernel(wq, k, 2, NULL, global, local, 0, NULL, NULL);
    if (err == CL_SUCCESS)
        err = clEnqueueReadBuffer(wq, bc, CL_TRUE, 0, sizeof c, c, 0, NULL, NULL);
    w->result = err == CL_SUCCESS ? digest(c, sizeof c) : (uint64_t)(int64_t)err;
    clReleaseKernel(k);
    clReleaseMemObject(ba);
    clReleaseMemObject(bb);
    clReleaseMemObject(bc);
    clReleaseCommandQueue(wq);
    return NULL;
}

static void check_threads(cl_program program) {
    enum { THREADS = 4 };
    pthread_t threads[THREADS];
    worker workers[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (worker){program, i, 0};
        pthread_create(&threads[i], NULL, work, &workers[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        printf("thread %d: %016llx\n", i, (unsigned long long)workers[i].result);
    }
}

static void check_large_transfer(void) {
    size_t size = 48u << 20; /* (past the pool's frame limit in a test that lowers it: chunks) */
    unsigned char *data = malloc(size), *back = malloc(size);
    uint32_t seed = 5;
    for (size_t i = 0; i < size; i += 4) {
        uint32_t v = lcg(&seed);
        memcpy(data + i, &v, 4);
    }
    cl_mem b = buffer(CL_MEM_READ_WRITE, size, NULL);
    CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, size, data, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, size, back, 0, NULL, NULL));
    printf("48 MiB round trip: %s %016llx\n", memcmp(data, back, size) == 0 ? "equal" : "DIFFERENT",
           (unsigned long long)digest(back, size));
    clReleaseMemObject(b);
    free(data);
    free(back);
}

static void check_queries_and_refusals(void) {
    cl_int err;
    cl_bool images;
    CHECK(clGetDeviceInfo(dev, CL_DEVICE_IMAGE_SUPPORT, sizeof images, &images, NULL));
    printf("zero-size buffer: %s", clCreateBuffer(ctx, CL_MEM_READ_WRITE, 0, NULL, &err) == NULL ? "null" : "made");
    printf(" %d\n", err);
    cl_mem no_ptr = clCreateBuffer(ctx, CL_MEM_USE_HOST_PTR, 64, NULL, &err);
    printf("use-host-ptr without a pointer: %s %d\n", no_ptr == NULL ? "null" : "made", err);
    cl_mem both = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_WRITE_ONLY, 64, NULL, &err);
    printf("read-only and write-only: %s %d\n", both == NULL ? "null" : "made", err);
    cl_command_queue_properties props;
    CHECK(clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof props, &props, NULL));
    printf("queue properties: %#llx\n", (unsigned long long)props);
}

/* Launches with a global work offset: each a slice of the buffer, in 1 and 2 dimensions. */
static void check_global_offset(cl_program program) {
    cl_int err;
    int data[64 * 4];
    for (int i = 0; i < 64 * 4; i++)
        data[i] = i;
    cl_mem b = buffer(CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof data, data);
    cl_kernel k = clCreateKernel(program, "bump", &err);
    CHECK(err);
    for (int slice = 0; slice < 8; slice++) {
        int by = slice + 1;
        size_t offset = (size_t)slice * 16, global = 16;
        CHECK(clSetKernelArg(k, 0, sizeof b, &b));
        CHECK(clSetKernelArg(k, 1, sizeof by, &by));
        CHECK(clEnqueueNDRangeKernel(q, k, 1, &offset, &global, NULL, 0, NULL, NULL));
    }
    cl_kernel m = clCreateKernel(program, "matrix", &err);
    CHECK(err);
    float a[16 * 16], bb[16 * 16], c[16 * 16];
    for (int i = 0; i < 16 * 16; i++) {
        a[i] = (float)(i % 7);
        bb[i] = (float)(i % 5) - 2.0f;
        c[i] = -1.0f;
    }
    cl_mem ma = buffer(CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof a, a);
    cl_mem mb = buffer(CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof bb, bb);
    cl_mem mc = buffer(CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof c, c);
    int n = 16;
    size_t offset2[2] = {4, 8}, global2[2] = {8, 4}, local2[2] = {4, 2};
    CHECK(clSetKernelArg(m, 0, sizeof mc, &mc));
    CHECK(clSetKernelArg(m, 1, sizeof ma, &ma));
    CHECK(clSetKernelArg(m, 2, sizeof mb, &mb));
    CHECK(clSetKernelArg(m, 3, sizeof n, &n));
    CHECK(clEnqueueNDRangeKernel(q, m, 2, offset2, global2, local2, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof data, data, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, mc, CL_TRUE, 0, sizeof c, c, 0, NULL, NULL));
    printf("global offsets: %016llx %016llx\n", (unsigned long long)digest(data, sizeof data),
           (unsigned long long)digest(c, sizeof c));
    clReleaseKernel(k);
    clReleaseKernel(m);
    clReleaseMemObject(b);
    clReleaseMemObject(ma);
    clReleaseMemObject(mb);
    clReleaseMemObject(mc);
}

/* Contexts the application lets go of while their commands are in flight:
 * the commands' replies then hold the last references (the buffer's
 * allocation and its first content arrive in one read: the context must
 * end once, whichever reply lets it go). */
static void check_released_in_flight(void) {
    static unsigned char data[1 << 12];
    int made = 0;
    for (int round = 0; round < 8; round++) {
        cl_int err;
        cl_context other = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
        if (other == NULL)
            continue;
        cl_mem b = clCreateBuffer(other, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof data, data, &err);
        CHECK(err);
        CHECK(clReleaseMemObject(b));
        CHECK(clReleaseContext(other));
        made++;
    }
    printf("contexts released with commands in flight: %d\n", made);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* (a line at a time: what came before a crash is there) */
    cl_platform_id platform;
    cl_uint n;
    if (clGetPlatformIDs(1, &platform, &n) != CL_SUCCESS || n == 0) {
        printf("no platform\n");
        return 2;
    }
    cl_int err = clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &dev, &n);
    if (err != CL_SUCCESS) {
        printf("no device: %d\n", err);
        return 2;
    }
    ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    if (ctx == NULL) {
        printf("no context: %d\n", err);
        return 2;
    }
    q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    CHECK(err);
    cl_program program = build(SOURCE, NULL);
    check_saxpy(program);
    check_local_memory(program);
    check_doubles_and_values(program);
    check_fill_rect_copy();
    check_sub_buffers_and_maps(program);
    check_events(program);
    check_profiling(program);
    check_programs();
    check_threads(program);
    check_large_transfer();
    check_global_offset(program);
    check_headers_compile_and_link();
    check_queries_and_refusals();
    check_released_in_flight();
    CHECK(clFinish(q));
    clReleaseProgram(program);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("failures: %d\n", failures);
    return failures ? 1 : 0;
}

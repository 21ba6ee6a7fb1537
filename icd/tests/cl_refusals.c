/* What the accelmig driver does not offer, asked for the way applications
 * ask: each answer printed as "what: code" (tests/icd checks each is the
 * code OpenCL gives for it), and no crash whatever is asked. */
#include <CL/cl.h>
#include <stdio.h>

static cl_context ctx;
static cl_device_id dev;
static cl_command_queue q;

static void say(const char *what, cl_int code) {
    printf("%s: %d\n", what, code);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    cl_platform_id platform;
    cl_int err;
    if (clGetPlatformIDs(1, &platform, NULL) != CL_SUCCESS || clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &dev,
                                                                               NULL) != CL_SUCCESS) {
        printf("no device\n");
        return 2;
    }
    ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    cl_bool images;
    clGetDeviceInfo(dev, CL_DEVICE_IMAGE_SUPPORT, sizeof images, &images, NULL);
    say("image support", images);

    cl_image_format format = {CL_RGBA, CL_UNORM_INT8};
    cl_image_desc desc = {0};
    desc.image_type = CL_MEM_OBJECT_IMAGE2D;
    desc.image_width = desc.image_height = 16;
    clCreateImage(ctx, CL_MEM_READ_WRITE, &format, &desc, NULL, &err);
    say("clCreateImage", err);
    cl_uint formats = 99;
    say("clGetSupportedImageFormats", clGetSupportedImageFormats(ctx, CL_MEM_READ_ONLY, CL_MEM_OBJECT_IMAGE2D, 0,
                                                                 NULL, &formats));
    say("image formats", (cl_int)formats);
    clCreateSamplerWithProperties(ctx, NULL, &err);
    say("clCreateSamplerWithProperties", err);
    say("clSVMAlloc gives NULL", clSVMAlloc(ctx, CL_MEM_READ_WRITE, 64, 0) == NULL);
    clCreatePipe(ctx, CL_MEM_READ_WRITE, 4, 16, NULL, &err);
    say("clCreatePipe", err);
    cl_device_partition_property equally[] = {CL_DEVICE_PARTITION_EQUALLY, 1, 0};
    cl_device_id sub[4];
    cl_uint nsub;
    say("clCreateSubDevices", clCreateSubDevices(dev, equally, 4, sub, &nsub));
    clCreateProgramWithIL(ctx, "\x03\x02\x23\x07", 4, &err);
    say("clCreateProgramWithIL", err);
    clCreateProgramWithBuiltInKernels(ctx, 1, &dev, "pocl.add.i8", &err);
    say("clCreateProgramWithBuiltInKernels", err);

    const char *source = "kernel void k(global int *x) { x[get_global_id(0)] = 1; }";
    cl_program program = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
    say("clCompileProgram", clCompileProgram(program, 1, &dev, "", 0, NULL, NULL, NULL, NULL));
    say("clBuildProgram", clBuildProgram(program, 1, &dev, "", NULL, NULL));
    cl_kernel kernel = clCreateKernel(program, "k", &err);
    cl_mem buffer = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 64 * sizeof(int), NULL, &err);
    clSetKernelArg(kernel, 0, sizeof buffer, &buffer);
    say("clGetKernelArgInfo without -cl-kernel-arg-info",
        clGetKernelArgInfo(kernel, 0, CL_KERNEL_ARG_NAME, 0, NULL, NULL));
    size_t offset = 8, global = 8;
    say("a global work offset", clEnqueueNDRangeKernel(q, kernel, 1, &offset, &global, NULL, 0, NULL, NULL));
    say("clEnqueueNativeKernel", clEnqueueNativeKernel(q, NULL, NULL, 0, 0, NULL, NULL, 0, NULL, NULL));
    say("clSetKernelArgSVMPointer", clSetKernelArgSVMPointer(kernel, 0, NULL));
    size_t origin[3] = {0, 0, 0}, region[3] = {1, 1, 1};
    int pixel[4];
    say("clEnqueueReadImage of a buffer", clEnqueueReadImage(q, buffer, CL_TRUE, origin, region, 0, 0, pixel, 0, NULL,
                                                             NULL));
    cl_ulong host_time;
    say("clGetHostTimer", clGetHostTimer(dev, &host_time));
    cl_device_id two[2] = {dev, dev};
    cl_context both = clCreateContext(NULL, 2, two, NULL, NULL, &err);
    say("a context of the same device twice", both != NULL ? CL_SUCCESS : err);
    if (both != NULL)
        clReleaseContext(both);
    say("clFinish", clFinish(q));
    clReleaseMemObject(buffer);
    clReleaseKernel(kernel);
    clReleaseProgram(program);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("done\n");
    return 0;
}

/* What this driver does not offer, answered the way OpenCL says (never a
 * missing dispatch entry, never a crash): no images or samplers (the
 * devices say CL_DEVICE_IMAGE_SUPPORT = CL_FALSE), no pipes, no shared
 * virtual memory, no device-side queues, no sharing with GL or EGL (no
 * context is made from one), no sub-devices.  Each answer is the code the
 * specification gives for a device or context without the feature.
 * (Written from cl_icd.h's function types: the compiler checks each
 * against its dispatch entry.) */
#include "icd.h"

/* Every stub takes its entry point's parameters and reads none of them: the
 * build names this file's unused parameters no warning (CMakeLists.txt). */

static cl_mem CL_API_CALL am_clCreateImage2D(cl_context a0, cl_mem_flags a1, const cl_image_format *a2, size_t a3, size_t a4, size_t a5, void *a6, cl_int *a7) {
    if (a7 != NULL)
        *a7 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateImage3D(cl_context a0, cl_mem_flags a1, const cl_image_format *a2, size_t a3, size_t a4, size_t a5, size_t a6, size_t a7, void *a8, cl_int *a9) {
    if (a9 != NULL)
        *a9 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateImage(cl_context a0, cl_mem_flags a1, const cl_image_format *a2, const cl_image_desc *a3, void *a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateImageWithProperties(cl_context a0, const cl_mem_properties *a1, cl_mem_flags a2, const cl_image_format *a3, const cl_image_desc *a4, void *a5, cl_int *a6) {
    if (a6 != NULL)
        *a6 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_int CL_API_CALL am_clGetImageInfo(cl_mem a0, cl_image_info a1, size_t a2, void *a3, size_t *a4) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueReadImage(cl_command_queue a0, cl_mem a1, cl_bool a2, const size_t *a3, const size_t *a4, size_t a5, size_t a6, void *a7, cl_uint a8, const cl_event *a9, cl_event *a10) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueWriteImage(cl_command_queue a0, cl_mem a1, cl_bool a2, const size_t *a3, const size_t *a4, size_t a5, size_t a6, const void *a7, cl_uint a8, const cl_event *a9, cl_event *a10) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueCopyImage(cl_command_queue a0, cl_mem a1, cl_mem a2, const size_t *a3, const size_t *a4, const size_t *a5, cl_uint a6, const cl_event *a7, cl_event *a8) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueCopyImageToBuffer(cl_command_queue a0, cl_mem a1, cl_mem a2, const size_t *a3, const size_t *a4, size_t a5, cl_uint a6, const cl_event *a7, cl_event *a8) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueCopyBufferToImage(cl_command_queue a0, cl_mem a1, cl_mem a2, size_t a3, const size_t *a4, const size_t *a5, cl_uint a6, const cl_event *a7, cl_event *a8) {
    return CL_INVALID_MEM_OBJECT;
}

static void * CL_API_CALL am_clEnqueueMapImage(cl_command_queue a0, cl_mem a1, cl_bool a2, cl_map_flags a3, const size_t *a4, const size_t *a5, size_t *a6, size_t *a7, cl_uint a8, const cl_event *a9, cl_event *a10, cl_int *a11) {
    if (a11 != NULL)
        *a11 = CL_INVALID_MEM_OBJECT;
    return NULL;
}

static cl_int CL_API_CALL am_clEnqueueFillImage(cl_command_queue a0, cl_mem a1, const void *a2, const size_t a3[3], const size_t a4[3], cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_MEM_OBJECT;
}

static cl_sampler CL_API_CALL am_clCreateSampler(cl_context a0, cl_bool a1, cl_addressing_mode a2, cl_filter_mode a3, cl_int *a4) {
    if (a4 != NULL)
        *a4 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_int CL_API_CALL am_clRetainSampler(cl_sampler a0) {
    return CL_INVALID_SAMPLER;
}

static cl_int CL_API_CALL am_clReleaseSampler(cl_sampler a0) {
    return CL_INVALID_SAMPLER;
}

static cl_int CL_API_CALL am_clGetSamplerInfo(cl_sampler a0, cl_sampler_info a1, size_t a2, void *a3, size_t *a4) {
    return CL_INVALID_SAMPLER;
}

static cl_mem CL_API_CALL am_clCreatePipe(cl_context a0, cl_mem_flags a1, cl_uint a2, cl_uint a3, const cl_pipe_properties *a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_OPERATION;
    return NULL;
}

static cl_int CL_API_CALL am_clGetPipeInfo(cl_mem a0, cl_pipe_info a1, size_t a2, void *a3, size_t *a4) {
    return CL_INVALID_MEM_OBJECT;
}

static void * CL_API_CALL am_clSVMAlloc(cl_context a0, cl_svm_mem_flags a1, size_t a2, unsigned int a3) {
    return NULL;
}

static void CL_API_CALL am_clSVMFree(cl_context a0, void *a1) {
}

static cl_int CL_API_CALL am_clEnqueueSVMFree(cl_command_queue a0, cl_uint a1, void **a2, void(CL_CALLBACK *a3)(cl_command_queue , cl_uint , void ** , void * ), void *a4, cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clEnqueueSVMMemcpy(cl_command_queue a0, cl_bool a1, void *a2, const void *a3, size_t a4, cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clEnqueueSVMMemFill(cl_command_queue a0, void *a1, const void *a2, size_t a3, size_t a4, cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clEnqueueSVMMap(cl_command_queue a0, cl_bool a1, cl_map_flags a2, void *a3, size_t a4, cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clEnqueueSVMUnmap(cl_command_queue a0, void *a1, cl_uint a2, const cl_event *a3, cl_event *a4) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clEnqueueSVMMigrateMem(cl_command_queue a0, cl_uint a1, const void **a2, const size_t *a3, cl_mem_migration_flags a4, cl_uint a5, const cl_event *a6, cl_event *a7) {
    return CL_INVALID_OPERATION;
}

static cl_int CL_API_CALL am_clSetDefaultDeviceCommandQueue(cl_context a0, cl_device_id a1, cl_command_queue a2) {
    return CL_INVALID_OPERATION;
}

static cl_mem CL_API_CALL am_clCreateFromGLBuffer(cl_context a0, cl_mem_flags a1, cl_GLuint a2, int *a3) {
    if (a3 != NULL)
        *a3 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateFromGLTexture(cl_context a0, cl_mem_flags a1, cl_GLenum a2, cl_GLint a3, cl_GLuint a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateFromGLTexture2D(cl_context a0, cl_mem_flags a1, cl_GLenum a2, cl_GLint a3, cl_GLuint a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateFromGLTexture3D(cl_context a0, cl_mem_flags a1, cl_GLenum a2, cl_GLint a3, cl_GLuint a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateFromGLRenderbuffer(cl_context a0, cl_mem_flags a1, cl_GLuint a2, cl_int *a3) {
    if (a3 != NULL)
        *a3 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_int CL_API_CALL am_clGetGLObjectInfo(cl_mem a0, cl_gl_object_type *a1, cl_GLuint *a2) {
    return CL_INVALID_GL_OBJECT;
}

static cl_int CL_API_CALL am_clGetGLTextureInfo(cl_mem a0, cl_gl_texture_info a1, size_t a2, void *a3, size_t *a4) {
    return CL_INVALID_GL_OBJECT;
}

static cl_int CL_API_CALL am_clEnqueueAcquireGLObjects(cl_command_queue a0, cl_uint a1, const cl_mem *a2, cl_uint a3, const cl_event *a4, cl_event *a5) {
    return CL_INVALID_CONTEXT;
}

static cl_int CL_API_CALL am_clEnqueueReleaseGLObjects(cl_command_queue a0, cl_uint a1, const cl_mem *a2, cl_uint a3, const cl_event *a4, cl_event *a5) {
    return CL_INVALID_CONTEXT;
}

static cl_int CL_API_CALL am_clGetGLContextInfoKHR(const cl_context_properties *a0, cl_gl_context_info a1, size_t a2, void *a3, size_t *a4) {
    return CL_INVALID_OPERATION;
}

static cl_event CL_API_CALL am_clCreateEventFromGLsyncKHR(cl_context a0, cl_GLsync a1, cl_int *a2) {
    if (a2 != NULL)
        *a2 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_mem CL_API_CALL am_clCreateFromEGLImageKHR(cl_context a0, CLeglDisplayKHR a1, CLeglImageKHR a2, cl_mem_flags a3, const cl_egl_image_properties_khr *a4, cl_int *a5) {
    if (a5 != NULL)
        *a5 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_int CL_API_CALL am_clEnqueueAcquireEGLObjectsKHR(cl_command_queue a0, cl_uint a1, const cl_mem *a2, cl_uint a3, const cl_event *a4, cl_event *a5) {
    return CL_INVALID_CONTEXT;
}

static cl_int CL_API_CALL am_clEnqueueReleaseEGLObjectsKHR(cl_command_queue a0, cl_uint a1, const cl_mem *a2, cl_uint a3, const cl_event *a4, cl_event *a5) {
    return CL_INVALID_CONTEXT;
}

static cl_event CL_API_CALL am_clCreateEventFromEGLSyncKHR(cl_context a0, CLeglSyncKHR a1, CLeglDisplayKHR a2, cl_int *a3) {
    if (a3 != NULL)
        *a3 = CL_INVALID_CONTEXT;
    return NULL;
}

static cl_int CL_API_CALL am_clCreateSubDevicesEXT(cl_device_id a0, const cl_device_partition_property_ext *a1, cl_uint a2, cl_device_id *a3, cl_uint *a4) {
    return CL_INVALID_VALUE;
}

static cl_int CL_API_CALL am_clRetainDeviceEXT(cl_device_id a0) {
    return CL_INVALID_DEVICE;
}

static cl_int CL_API_CALL am_clReleaseDeviceEXT(cl_device_id a0) {
    return CL_INVALID_DEVICE;
}

static cl_int CL_API_CALL am_clGetKernelSubGroupInfoKHR(cl_kernel a0, cl_device_id a1, cl_kernel_sub_group_info a2, size_t a3, const void *a4, size_t a5, void *a6, size_t *a7) {
    return CL_INVALID_OPERATION;
}

static cl_sampler CL_API_CALL am_clCreateSamplerWithProperties(cl_context a0, const cl_sampler_properties *a1,
                                                              cl_int *a2) {
    if (a2 != NULL)
        *a2 = CL_INVALID_OPERATION;
    return NULL;
}

void am_stub_functions(cl_icd_dispatch *d);
void am_stub_functions(cl_icd_dispatch *d) {
    d->clCreateImage2D = am_clCreateImage2D;
    d->clCreateImage3D = am_clCreateImage3D;
    d->clCreateImage = am_clCreateImage;
    d->clCreateImageWithProperties = am_clCreateImageWithProperties;
    d->clGetImageInfo = am_clGetImageInfo;
    d->clEnqueueReadImage = am_clEnqueueReadImage;
    d->clEnqueueWriteImage = am_clEnqueueWriteImage;
    d->clEnqueueCopyImage = am_clEnqueueCopyImage;
    d->clEnqueueCopyImageToBuffer = am_clEnqueueCopyImageToBuffer;
    d->clEnqueueCopyBufferToImage = am_clEnqueueCopyBufferToImage;
    d->clEnqueueMapImage = am_clEnqueueMapImage;
    d->clEnqueueFillImage = am_clEnqueueFillImage;
    d->clCreateSampler = am_clCreateSampler;
    d->clRetainSampler = am_clRetainSampler;
    d->clReleaseSampler = am_clReleaseSampler;
    d->clGetSamplerInfo = am_clGetSamplerInfo;
    d->clCreatePipe = am_clCreatePipe;
    d->clGetPipeInfo = am_clGetPipeInfo;
    d->clSVMAlloc = am_clSVMAlloc;
    d->clSVMFree = am_clSVMFree;
    d->clEnqueueSVMFree = am_clEnqueueSVMFree;
    d->clEnqueueSVMMemcpy = am_clEnqueueSVMMemcpy;
    d->clEnqueueSVMMemFill = am_clEnqueueSVMMemFill;
    d->clEnqueueSVMMap = am_clEnqueueSVMMap;
    d->clEnqueueSVMUnmap = am_clEnqueueSVMUnmap;
    d->clEnqueueSVMMigrateMem = am_clEnqueueSVMMigrateMem;
    d->clSetDefaultDeviceCommandQueue = am_clSetDefaultDeviceCommandQueue;
    d->clCreateFromGLBuffer = am_clCreateFromGLBuffer;
    d->clCreateFromGLTexture = am_clCreateFromGLTexture;
    d->clCreateFromGLTexture2D = am_clCreateFromGLTexture2D;
    d->clCreateFromGLTexture3D = am_clCreateFromGLTexture3D;
    d->clCreateFromGLRenderbuffer = am_clCreateFromGLRenderbuffer;
    d->clGetGLObjectInfo = am_clGetGLObjectInfo;
    d->clGetGLTextureInfo = am_clGetGLTextureInfo;
    d->clEnqueueAcquireGLObjects = am_clEnqueueAcquireGLObjects;
    d->clEnqueueReleaseGLObjects = am_clEnqueueReleaseGLObjects;
    d->clGetGLContextInfoKHR = am_clGetGLContextInfoKHR;
    d->clCreateEventFromGLsyncKHR = am_clCreateEventFromGLsyncKHR;
    d->clCreateFromEGLImageKHR = am_clCreateFromEGLImageKHR;
    d->clEnqueueAcquireEGLObjectsKHR = am_clEnqueueAcquireEGLObjectsKHR;
    d->clEnqueueReleaseEGLObjectsKHR = am_clEnqueueReleaseEGLObjectsKHR;
    d->clCreateEventFromEGLSyncKHR = am_clCreateEventFromEGLSyncKHR;
    d->clCreateSubDevicesEXT = am_clCreateSubDevicesEXT;
    d->clRetainDeviceEXT = am_clRetainDeviceEXT;
    d->clReleaseDeviceEXT = am_clReleaseDeviceEXT;
    d->clGetKernelSubGroupInfoKHR = am_clGetKernelSubGroupInfoKHR;
    d->clCreateSamplerWithProperties = am_clCreateSamplerWithProperties;
}

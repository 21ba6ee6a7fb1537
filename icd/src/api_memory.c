/* Buffers and sub-buffers: device memory at the pool (alloc/alloc_sub,
 * free), their creation flags kept as OpenCL says (CL_MEM_COPY_HOST_PTR
 * and CL_MEM_USE_HOST_PTR: the host bytes are the buffer's first content;
 * with USE_HOST_PTR maps hand out the application's own memory), and the
 * host copy ("mirror") maps use otherwise.  Images: none (the devices say
 * CL_DEVICE_IMAGE_SUPPORT = CL_FALSE; api_stubs.c answers them). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "icd.h"
#include "log.h"

bool am_is_mem(cl_mem mem) {
    return mem != NULL && mem->magic == AM_MAGIC_MEM;
}

cl_mem am_mem_root(cl_mem mem) {
    return mem->parent != NULL ? mem->parent : mem;
}

void am_mem_retain(cl_mem mem) {
    atomic_fetch_add(&mem->refs, 1);
}

/* A command of a buffer that no event follows (its creation, its end). */
static cl_int submit_plain(cl_context ctx, am_cmd *cmd) {
    am_error err;
    if (am_session_submit(ctx->session, cmd, NULL, &err) != 0) {
        am_cmd_free(cmd);
        return am_error_to_cl(&err, CL_OUT_OF_RESOURCES);
    }
    return CL_SUCCESS;
}

void am_mem_release(cl_mem mem) {
    if (atomic_fetch_sub(&mem->refs, 1) != 1)
        return;
    cl_context ctx = mem->context;
    am_ctx_remove_mem(ctx, mem);
    char fields[64];
    snprintf(fields, sizeof fields, "\"buf\":%" PRIu64, mem->handle);
    /* after every command sent before it (the session is in order): the pool frees it when they ran */
    am_cmd *free_cmd = am_cmd_new("free", fields, NULL, 0, false);
    if (free_cmd == NULL || submit_plain(ctx, free_cmd) != CL_SUCCESS)
        am_info("buffer %" PRIu64 ": its free was not sent (the session is gone: so is the buffer)", mem->handle);
    for (struct am_mem_destructor *d = mem->destructors, *next; d != NULL; d = next) {
        next = d->next;
        d->fn(mem, d->data);
        free(d);
    }
    for (am_mapping *m = mem->mappings, *next; m != NULL; m = next) {
        next = m->next;
        free(m);
    }
    if (mem->parent != NULL)
        am_mem_release(mem->parent);
    mem->magic = AM_MAGIC_DEAD;
    free(mem->mirror);
    free(mem->props);
    pthread_mutex_destroy(&mem->mu);
    free(mem);
    am_ctx_release(ctx);
}

static void alloc_answered(am_cmd *cmd, void *arg) {
    cl_mem mem = arg;
    if (!cmd->ok) {
        atomic_store(&mem->alloc_error, am_error_to_cl(&cmd->error, CL_MEM_OBJECT_ALLOCATION_FAILURE));
        am_warn("buffer %" PRIu64 " of %zu bytes: the pool refused it: %s", mem->handle, mem->size,
                cmd->error.message);
    }
    am_mem_release(mem);
}

/* The first content of a buffer, from host memory (chunked to the pool's
 * frame limit).  `borrow`: the bytes stay valid as long as the buffer
 * (USE_HOST_PTR); else they are copied, or, when large, sent from the
 * caller's memory and waited for. */
static cl_int write_initial(cl_context ctx, uint64_t handle, const void *data, size_t size, bool borrow) {
    uint64_t chunk = am_session_chunk(ctx->session);
    bool wait = !borrow && size >= AM_ZERO_COPY_WRITE;
    for (size_t done = 0; done < size;) {
        size_t len = size - done > chunk ? (size_t)chunk : size - done;
        const uint8_t *from = (const uint8_t *)data + done;
        void *copy = NULL;
        if (!borrow && !wait) {
            copy = malloc(len);
            if (copy == NULL)
                return CL_OUT_OF_HOST_MEMORY;
            memcpy(copy, from, len);
        }
        char fields[96];
        snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"offset\":%zu", handle, done);
        am_cmd *cmd = am_cmd_new("write", fields, copy != NULL ? copy : from, len, copy != NULL);
        if (cmd == NULL) {
            free(copy);
            return CL_OUT_OF_HOST_MEMORY;
        }
        cmd->completes = true;
        cl_int err = wait ? am_call(ctx, cmd, CL_OUT_OF_RESOURCES, NULL) : submit_plain(ctx, cmd);
        if (err != CL_SUCCESS)
            return err;
        done += len;
    }
    return CL_SUCCESS;
}

static const cl_mem_flags ACCESS = CL_MEM_READ_WRITE | CL_MEM_WRITE_ONLY | CL_MEM_READ_ONLY;
static const cl_mem_flags HOST_ACCESS = CL_MEM_HOST_WRITE_ONLY | CL_MEM_HOST_READ_ONLY | CL_MEM_HOST_NO_ACCESS;

static bool at_most_one(cl_mem_flags flags) {
    return (flags & (flags - 1)) == 0;
}

static cl_mem make_mem(cl_context ctx, cl_mem_flags flags, size_t size) {
    cl_mem mem = calloc(1, sizeof *mem);
    if (mem == NULL)
        return NULL;
    mem->dispatch = &am_dispatch;
    atomic_init(&mem->refs, 1);
    atomic_init(&mem->alloc_error, 0);
    mem->context = ctx;
    mem->flags = flags;
    mem->size = size;
    pthread_mutex_init(&mem->mu, NULL);
    return mem;
}

static cl_mem create_buffer(cl_context ctx, const cl_mem_properties *props, cl_mem_flags flags, size_t size,
                            void *host_ptr, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_mem mem = NULL;
    const cl_mem_flags known = ACCESS | HOST_ACCESS | CL_MEM_USE_HOST_PTR | CL_MEM_ALLOC_HOST_PTR |
                               CL_MEM_COPY_HOST_PTR;
    size_t props_len = 0;
    if (props != NULL) {
        if (props[0] != 0) { /* no buffer property is known to this driver */
            err = CL_INVALID_PROPERTY;
            goto out;
        }
        props_len = 1;
    }
    if (!am_is_context(ctx)) {
        err = CL_INVALID_CONTEXT;
        goto out;
    }
    if ((flags & ~known) || !at_most_one(flags & ACCESS) || !at_most_one(flags & HOST_ACCESS) ||
        ((flags & CL_MEM_USE_HOST_PTR) && (flags & (CL_MEM_ALLOC_HOST_PTR | CL_MEM_COPY_HOST_PTR)))) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    if (size == 0 || size > am_device_uint(ctx->device, CL_DEVICE_MAX_MEM_ALLOC_SIZE)) {
        err = CL_INVALID_BUFFER_SIZE;
        goto out;
    }
    bool needs_ptr = (flags & (CL_MEM_USE_HOST_PTR | CL_MEM_COPY_HOST_PTR)) != 0;
    if (needs_ptr != (host_ptr != NULL)) {
        err = CL_INVALID_HOST_PTR;
        goto out;
    }
    if ((flags & ACCESS) == 0)
        flags |= CL_MEM_READ_WRITE;
    mem = make_mem(ctx, flags, size);
    if (mem == NULL || (props_len && (mem->props = calloc(1, sizeof *mem->props)) == NULL)) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto fail;
    }
    mem->props_len = props_len;
    if (flags & CL_MEM_USE_HOST_PTR)
        mem->host_ptr = host_ptr;
    mem->handle = am_session_handle(ctx->session);
    char fields[96];
    snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"size\":%zu", mem->handle, size);
    am_cmd *alloc = am_cmd_new("alloc", fields, NULL, 0, false);
    if (alloc == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto fail;
    }
    am_mem_retain(mem); /* the hook's */
    alloc->on_reply = alloc_answered;
    alloc->hook_ctx = mem;
    if ((err = submit_plain(ctx, alloc)) != CL_SUCCESS) {
        atomic_fetch_sub(&mem->refs, 1);
        goto fail;
    }
    mem->magic = AM_MAGIC_MEM;
    am_ctx_retain(ctx);
    am_ctx_add_mem(ctx, mem);
    if (needs_ptr && (err = write_initial(ctx, mem->handle, host_ptr, size, (flags & CL_MEM_USE_HOST_PTR) != 0)) !=
                         CL_SUCCESS) {
        am_mem_release(mem);
        mem = NULL;
    }
    goto out;
fail:
    if (mem != NULL) {
        pthread_mutex_destroy(&mem->mu);
        free(mem->props);
        free(mem);
    }
    mem = NULL;
out:
    if (errcode != NULL)
        *errcode = err;
    return mem;
}

static cl_mem CL_API_CALL am_clCreateBuffer(cl_context ctx, cl_mem_flags flags, size_t size, void *host_ptr,
                                            cl_int *errcode) {
    return create_buffer(ctx, NULL, flags, size, host_ptr, errcode);
}

static cl_mem CL_API_CALL am_clCreateBufferWithProperties(cl_context ctx, const cl_mem_properties *props,
                                                          cl_mem_flags flags, size_t size, void *host_ptr,
                                                          cl_int *errcode) {
    return create_buffer(ctx, props, flags, size, host_ptr, errcode);
}

static cl_mem CL_API_CALL am_clCreateSubBuffer(cl_mem parent, cl_mem_flags flags, cl_buffer_create_type type,
                                               const void *info, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_mem mem = NULL;
    const cl_buffer_region *region = info;
    if (!am_is_mem(parent) || parent->parent != NULL) {
        err = CL_INVALID_MEM_OBJECT;
        goto out;
    }
    if (type != CL_BUFFER_CREATE_TYPE_REGION || region == NULL ||
        (flags & ~(ACCESS | HOST_ACCESS)) != 0 || !at_most_one(flags & ACCESS) || !at_most_one(flags & HOST_ACCESS)) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    /* what the parent forbids, the sub-buffer may not ask */
    if (((parent->flags & CL_MEM_WRITE_ONLY) && (flags & (CL_MEM_READ_WRITE | CL_MEM_READ_ONLY))) ||
        ((parent->flags & CL_MEM_READ_ONLY) && (flags & (CL_MEM_READ_WRITE | CL_MEM_WRITE_ONLY))) ||
        ((parent->flags & CL_MEM_HOST_WRITE_ONLY) && (flags & CL_MEM_HOST_READ_ONLY)) ||
        ((parent->flags & CL_MEM_HOST_READ_ONLY) && (flags & CL_MEM_HOST_WRITE_ONLY)) ||
        ((parent->flags & CL_MEM_HOST_NO_ACCESS) && (flags & (CL_MEM_HOST_READ_ONLY | CL_MEM_HOST_WRITE_ONLY)))) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    if (region->size == 0) {
        err = CL_INVALID_BUFFER_SIZE;
        goto out;
    }
    if (region->origin > parent->size || region->size > parent->size - region->origin) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    cl_context ctx = parent->context;
    uint64_t align_bits = am_device_uint(ctx->device, CL_DEVICE_MEM_BASE_ADDR_ALIGN);
    uint64_t align = align_bits >= 8 ? align_bits / 8 : 1;
    if (region->origin % align != 0) {
        err = CL_MISALIGNED_SUB_BUFFER_OFFSET;
        goto out;
    }
    if ((flags & ACCESS) == 0)
        flags |= parent->flags & ACCESS;
    if ((flags & HOST_ACCESS) == 0)
        flags |= parent->flags & HOST_ACCESS;
    flags |= parent->flags & (CL_MEM_USE_HOST_PTR | CL_MEM_ALLOC_HOST_PTR | CL_MEM_COPY_HOST_PTR);
    mem = make_mem(ctx, flags, region->size);
    if (mem == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto out;
    }
    mem->parent = parent;
    mem->origin = region->origin;
    if (parent->host_ptr != NULL)
        mem->host_ptr = (uint8_t *)parent->host_ptr + region->origin;
    mem->handle = am_session_handle(ctx->session);
    char fields[160];
    snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"parent\":%" PRIu64 ",\"origin\":%zu,\"size\":%zu",
             mem->handle, parent->handle, region->origin, region->size);
    am_cmd *cmd = am_cmd_new("alloc_sub", fields, NULL, 0, false);
    if (cmd == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
    } else {
        am_mem_retain(mem);
        cmd->on_reply = alloc_answered;
        cmd->hook_ctx = mem;
        if ((err = submit_plain(ctx, cmd)) != CL_SUCCESS)
            atomic_fetch_sub(&mem->refs, 1);
    }
    if (err != CL_SUCCESS) {
        pthread_mutex_destroy(&mem->mu);
        free(mem);
        mem = NULL;
        goto out;
    }
    am_mem_retain(parent);
    am_ctx_retain(ctx);
    mem->magic = AM_MAGIC_MEM;
    am_ctx_add_mem(ctx, mem);
out:
    if (errcode != NULL)
        *errcode = err;
    return mem;
}

static cl_int CL_API_CALL am_clRetainMemObject(cl_mem mem) {
    if (!am_is_mem(mem))
        return CL_INVALID_MEM_OBJECT;
    am_mem_retain(mem);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseMemObject(cl_mem mem) {
    if (!am_is_mem(mem))
        return CL_INVALID_MEM_OBJECT;
    am_mem_release(mem);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clGetMemObjectInfo(cl_mem mem, cl_mem_info param, size_t size, void *value,
                                                size_t *size_ret) {
    if (!am_is_mem(mem))
        return CL_INVALID_MEM_OBJECT;
    switch (param) {
    case CL_MEM_TYPE: {
        cl_mem_object_type type = CL_MEM_OBJECT_BUFFER;
        return am_answer(size, value, size_ret, &type, sizeof type);
    }
    case CL_MEM_FLAGS:
        return am_answer(size, value, size_ret, &mem->flags, sizeof mem->flags);
    case CL_MEM_SIZE:
        return am_answer(size, value, size_ret, &mem->size, sizeof mem->size);
    case CL_MEM_HOST_PTR:
        return am_answer(size, value, size_ret, &mem->host_ptr, sizeof mem->host_ptr);
    case CL_MEM_MAP_COUNT: {
        pthread_mutex_lock(&mem->mu);
        cl_uint count = mem->map_count;
        pthread_mutex_unlock(&mem->mu);
        return am_answer(size, value, size_ret, &count, sizeof count);
    }
    case CL_MEM_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&mem->refs);
        return am_answer(size, value, size_ret, &refs, sizeof refs);
    }
    case CL_MEM_CONTEXT:
        return am_answer(size, value, size_ret, &mem->context, sizeof mem->context);
    case CL_MEM_ASSOCIATED_MEMOBJECT:
        return am_answer(size, value, size_ret, &mem->parent, sizeof mem->parent);
    case CL_MEM_OFFSET:
        return am_answer(size, value, size_ret, &mem->origin, sizeof mem->origin);
    case CL_MEM_USES_SVM_POINTER: {
        cl_bool no = CL_FALSE;
        return am_answer(size, value, size_ret, &no, sizeof no);
    }
    case CL_MEM_PROPERTIES:
        return am_answer(size, value, size_ret, mem->props, mem->props_len * sizeof *mem->props);
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_int CL_API_CALL am_clSetMemObjectDestructorCallback(cl_mem mem, void(CL_CALLBACK *fn)(cl_mem, void *),
                                                              void *data) {
    if (!am_is_mem(mem))
        return CL_INVALID_MEM_OBJECT;
    if (fn == NULL)
        return CL_INVALID_VALUE;
    struct am_mem_destructor *d = malloc(sizeof *d);
    if (d == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    d->fn = fn;
    d->data = data;
    pthread_mutex_lock(&mem->mu);
    d->next = mem->destructors; /* called in the reverse order of their registration */
    mem->destructors = d;
    pthread_mutex_unlock(&mem->mu);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clGetSupportedImageFormats(cl_context ctx, cl_mem_flags flags, cl_mem_object_type type,
                                                        cl_uint num, cl_image_format *formats, cl_uint *num_ret) {
    (void)flags, (void)type, (void)num, (void)formats;
    if (!am_is_context(ctx))
        return CL_INVALID_CONTEXT;
    if (num_ret != NULL)
        *num_ret = 0; /* no image support */
    return CL_SUCCESS;
}

void am_memory_functions(cl_icd_dispatch *d);
void am_memory_functions(cl_icd_dispatch *d) {
    d->clCreateBuffer = am_clCreateBuffer;
    d->clCreateBufferWithProperties = am_clCreateBufferWithProperties;
    d->clCreateSubBuffer = am_clCreateSubBuffer;
    d->clRetainMemObject = am_clRetainMemObject;
    d->clReleaseMemObject = am_clReleaseMemObject;
    d->clGetMemObjectInfo = am_clGetMemObjectInfo;
    d->clSetMemObjectDestructorCallback = am_clSetMemObjectDestructorCallback;
    d->clGetSupportedImageFormats = am_clGetSupportedImageFormats;
}

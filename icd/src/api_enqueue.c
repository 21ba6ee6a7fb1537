/* The enqueue functions: each checks its arguments the OpenCL way (an
 * error code at once, nothing sent), then becomes an operation (am_op)
 * that sends its commands when its wait list allows (api_queue.c).
 *
 * Transfers larger than the pool's frame limit go as consecutive commands
 * of one chunk each (as the Python driver's); a rect transfer larger than
 * one chunk goes row by row.  A blocking write smaller than
 * AM_ZERO_COPY_WRITE is copied and returns at once; a larger one is sent
 * from the application's memory and waits for its reply; a non-blocking
 * one is sent from the application's memory, which OpenCL lets this
 * driver read until the command completes (its reply: a write completes
 * when the pool answers it). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "icd.h"
#include "log.h"

/* -- checks ------------------------------------------------------------------------- */

static cl_int check_queue_mem(cl_command_queue queue, cl_mem mem) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    if (!am_is_mem(mem))
        return CL_INVALID_MEM_OBJECT;
    if (mem->context != queue->context)
        return CL_INVALID_CONTEXT;
    cl_int refused = atomic_load(&mem->alloc_error);
    return refused != 0 ? refused : CL_SUCCESS;
}

static cl_int check_range(cl_mem mem, size_t offset, size_t size) {
    if (size == 0 || offset > mem->size || size > mem->size - offset)
        return CL_INVALID_VALUE;
    return CL_SUCCESS;
}

static bool host_may_read(cl_mem mem) {
    return (mem->flags & (CL_MEM_HOST_WRITE_ONLY | CL_MEM_HOST_NO_ACCESS)) == 0;
}

static bool host_may_write(cl_mem mem) {
    return (mem->flags & (CL_MEM_HOST_READ_ONLY | CL_MEM_HOST_NO_ACCESS)) == 0;
}

/* -- writes and reads ------------------------------------------------------------------ */

typedef struct transfer_op {
    am_op base;
    cl_mem mem;           /* retained */
    size_t offset, size;
    uint8_t *host;        /* the application's memory (a read's destination, a write's source) */
    uint8_t *copy;        /* owned: a small blocking write's bytes */
    cl_mem keep;          /* the buffer whose mirror `host` is (maps): kept alive until answered */
} transfer_op;

static void release_transfer(am_op *base) {
    transfer_op *op = (transfer_op *)base;
    free(op->copy);
    if (op->mem != NULL)
        am_mem_release(op->mem);
}

static cl_int run_transfer(transfer_op *op, bool write) {
    uint64_t chunk = am_session_chunk(op->base.queue->context->session);
    for (size_t done = 0; done < op->size;) {
        size_t len = op->size - done > chunk ? (size_t)chunk : op->size - done;
        bool last = done + len == op->size;
        char fields[96];
        if (write) /* (a write's size is its payload's) */
            snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"offset\":%zu", op->mem->handle, op->offset + done);
        else
            snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"offset\":%zu,\"size\":%zu", op->mem->handle,
                     op->offset + done, len);
        const uint8_t *payload = NULL;
        bool owned = false;
        if (write && op->copy != NULL) { /* (a copy is one chunk at most) */
            payload = op->copy;
            owned = true;
            op->copy = NULL;
        } else if (write) {
            payload = op->host + done;
        }
        am_cmd *cmd = am_op_cmd(&op->base, write ? "write" : "read", fields, payload, write ? len : 0, owned, true);
        if (cmd == NULL)
            return CL_OUT_OF_HOST_MEMORY;
        if (!write) {
            cmd->sink = op->host + done;
            cmd->sink_len = len;
        }
        if (op->keep != NULL && !am_op_cmd_keep(cmd, op->keep, NULL, NULL, NULL)) {
            am_cmd_free(cmd);
            return CL_OUT_OF_HOST_MEMORY;
        }
        cl_int err = am_op_submit(&op->base, cmd, last);
        if (err != CL_SUCCESS)
            return err;
        done += len;
    }
    return CL_SUCCESS;
}

static cl_int run_write(am_op *op) {
    return run_transfer((transfer_op *)op, true);
}

static cl_int run_read(am_op *op) {
    return run_transfer((transfer_op *)op, false);
}

static cl_int new_transfer(cl_command_queue queue, cl_mem mem, cl_command_type type, size_t offset, size_t size,
                           void *host, cl_uint num_waits, const cl_event *waits, transfer_op **out) {
    am_op *base;
    cl_int err = am_op_new(queue, sizeof(transfer_op), type, num_waits, waits, &base);
    if (err != CL_SUCCESS)
        return err;
    transfer_op *op = (transfer_op *)base;
    am_mem_retain(mem);
    op->mem = mem;
    op->offset = offset;
    op->size = size;
    op->host = host;
    base->release = release_transfer;
    *out = op;
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clEnqueueWriteBuffer(cl_command_queue queue, cl_mem mem, cl_bool blocking,
                                                  size_t offset, size_t size, const void *ptr, cl_uint num_waits,
                                                  const cl_event *waits, cl_event *event) {
    cl_int err = check_queue_mem(queue, mem);
    if (err != CL_SUCCESS)
        return err;
    if (ptr == NULL || (err = check_range(mem, offset, size)) != CL_SUCCESS)
        return CL_INVALID_VALUE;
    if (!host_may_write(mem))
        return CL_INVALID_OPERATION;
    transfer_op *op;
    if ((err = new_transfer(queue, mem, CL_COMMAND_WRITE_BUFFER, offset, size, (void *)ptr, num_waits, waits, &op)) !=
        CL_SUCCESS)
        return err;
    bool copy = blocking && size < AM_ZERO_COPY_WRITE;
    if (copy) {
        op->copy = malloc(size);
        if (op->copy == NULL) {
            am_op_free(&op->base);
            return CL_OUT_OF_HOST_MEMORY;
        }
        memcpy(op->copy, ptr, size);
    }
    op->base.run = run_write;
    return am_op_enqueue(&op->base, event, blocking && !copy);
}

static cl_int CL_API_CALL am_clEnqueueReadBuffer(cl_command_queue queue, cl_mem mem, cl_bool blocking, size_t offset,
                                                 size_t size, void *ptr, cl_uint num_waits, const cl_event *waits,
                                                 cl_event *event) {
    cl_int err = check_queue_mem(queue, mem);
    if (err != CL_SUCCESS)
        return err;
    if (ptr == NULL || check_range(mem, offset, size) != CL_SUCCESS)
        return CL_INVALID_VALUE;
    if (!host_may_read(mem))
        return CL_INVALID_OPERATION;
    transfer_op *op;
    if ((err = new_transfer(queue, mem, CL_COMMAND_READ_BUFFER, offset, size, ptr, num_waits, waits, &op)) !=
        CL_SUCCESS)
        return err;
    op->base.run = run_read;
    return am_op_enqueue(&op->base, event, blocking);
}

/* -- copies and fills ------------------------------------------------------------------- */

typedef struct device_op {
    am_op base;
    cl_mem mems[2];       /* retained (NULL when unused) */
    char *fields;         /* owned: the command's fields */
    const char *wire_op;
} device_op;

static void release_device_op(am_op *base) {
    device_op *op = (device_op *)base;
    for (int i = 0; i < 2; i++)
        if (op->mems[i] != NULL)
            am_mem_release(op->mems[i]);
    free(op->fields);
}

static cl_int run_device_op(am_op *base) {
    device_op *op = (device_op *)base;
    am_cmd *cmd = am_op_cmd(base, op->wire_op, op->fields, NULL, 0, false, false);
    if (cmd == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    return am_op_submit(base, cmd, true);
}

/* An operation of one command without payload that runs on the device
 * (copy, fill, copy_rect): its fields in `fields` (taken). */
static cl_int enqueue_device_op(cl_command_queue queue, cl_command_type type, const char *wire_op, char *fields,
                                cl_mem a, cl_mem b, cl_uint num_waits, const cl_event *waits, cl_event *event) {
    am_op *base;
    cl_int err = fields != NULL ? am_op_new(queue, sizeof(device_op), type, num_waits, waits, &base)
                                : CL_OUT_OF_HOST_MEMORY;
    if (err != CL_SUCCESS) {
        free(fields);
        return err;
    }
    device_op *op = (device_op *)base;
    op->fields = fields;
    op->wire_op = wire_op;
    op->mems[0] = a;
    op->mems[1] = b;
    am_mem_retain(a);
    if (b != NULL)
        am_mem_retain(b);
    base->run = run_device_op;
    base->release = release_device_op;
    return am_op_enqueue(base, event, false);
}

/* Two buffers' byte ranges that share memory (the same buffer, or
 * sub-buffers of one) and overlap. */
static bool ranges_overlap(cl_mem a, size_t a_offset, cl_mem b, size_t b_offset, size_t size) {
    if (am_mem_root(a) != am_mem_root(b))
        return false;
    size_t a_start = a->origin + a_offset, b_start = b->origin + b_offset;
    return a_start < b_start + size && b_start < a_start + size;
}

static cl_int CL_API_CALL am_clEnqueueCopyBuffer(cl_command_queue queue, cl_mem src, cl_mem dst, size_t src_offset,
                                                 size_t dst_offset, size_t size, cl_uint num_waits,
                                                 const cl_event *waits, cl_event *event) {
    cl_int err = check_queue_mem(queue, src);
    if (err == CL_SUCCESS)
        err = check_queue_mem(queue, dst);
    if (err != CL_SUCCESS)
        return err;
    if (check_range(src, src_offset, size) != CL_SUCCESS || check_range(dst, dst_offset, size) != CL_SUCCESS)
        return CL_INVALID_VALUE;
    if (ranges_overlap(src, src_offset, dst, dst_offset, size))
        return CL_MEM_COPY_OVERLAP;
    am_buf fields;
    am_buf_init(&fields);
    am_buf_printf(&fields, "\"src\":%" PRIu64 ",\"dst\":%" PRIu64 ",\"src_offset\":%zu,\"dst_offset\":%zu,\"size\":%zu",
                  src->handle, dst->handle, src_offset, dst_offset, size);
    return enqueue_device_op(queue, CL_COMMAND_COPY_BUFFER, "copy", am_buf_take(&fields), src, dst, num_waits,
                             waits, event);
}

static cl_int CL_API_CALL am_clEnqueueFillBuffer(cl_command_queue queue, cl_mem mem, const void *pattern,
                                                 size_t pattern_size, size_t offset, size_t size, cl_uint num_waits,
                                                 const cl_event *waits, cl_event *event) {
    cl_int err = check_queue_mem(queue, mem);
    if (err != CL_SUCCESS)
        return err;
    bool power_of_two = pattern_size != 0 && (pattern_size & (pattern_size - 1)) == 0;
    if (pattern == NULL || !power_of_two || pattern_size > 128 || offset % pattern_size || size % pattern_size ||
        check_range(mem, offset, size) != CL_SUCCESS)
        return CL_INVALID_VALUE;
    am_buf fields;
    am_buf_init(&fields);
    am_buf_printf(&fields, "\"buf\":%" PRIu64 ",\"offset\":%zu,\"size\":%zu,\"pattern\":\"", mem->handle, offset, size);
    for (size_t i = 0; i < pattern_size; i++)
        am_buf_printf(&fields, "%02x", ((const unsigned char *)pattern)[i]);
    am_buf_puts(&fields, "\"");
    return enqueue_device_op(queue, CL_COMMAND_FILL_BUFFER, "fill", am_buf_take(&fields), mem, NULL, num_waits,
                             waits, event);
}

/* -- rect transfers ------------------------------------------------------------------------ */

typedef struct rect_op {
    am_op base;
    cl_mem mem;           /* retained */
    am_rect buffer, host;
    uint8_t *host_base;   /* the application's */
} rect_op;

static void release_rect(am_op *base) {
    am_mem_release(((rect_op *)base)->mem);
}

static void rect_fields(am_buf *out, uint64_t handle, const am_rect *r) {
    am_buf_printf(out, "\"buf\":%" PRIu64 ",\"origin\":[%zu,%zu,%zu],\"region\":[%zu,%zu,%zu],\"row_pitch\":%zu,"
                  "\"slice_pitch\":%zu", handle, r->origin[0], r->origin[1], r->origin[2], r->region[0],
                  r->region[1], r->region[2], r->row_pitch, r->slice_pitch);
}

/* a rect too large for one command: row by row, each row a plain transfer */
static cl_int run_rect_rows(rect_op *op, bool write) {
    size_t rows = op->buffer.region[1] * op->buffer.region[2];
    uint64_t chunk = am_session_chunk(op->base.queue->context->session);
    size_t width = op->buffer.region[0];
    for (size_t row = 0; row < rows; row++) {
        size_t y = row % op->buffer.region[1], z = row / op->buffer.region[1];
        size_t at = op->buffer.offset + z * op->buffer.slice_pitch + y * op->buffer.row_pitch;
        uint8_t *host = op->host_base + op->host.offset + z * op->host.slice_pitch + y * op->host.row_pitch;
        for (size_t done = 0; done < width;) {
            size_t len = width - done > chunk ? (size_t)chunk : width - done;
            char fields[96];
            if (write)
                snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"offset\":%zu", op->mem->handle, at + done);
            else
                snprintf(fields, sizeof fields, "\"buf\":%" PRIu64 ",\"offset\":%zu,\"size\":%zu", op->mem->handle,
                         at + done, len);
            am_cmd *cmd = am_op_cmd(&op->base, write ? "write" : "read", fields, write ? host + done : NULL,
                                    write ? len : 0, false, true);
            if (cmd == NULL)
                return CL_OUT_OF_HOST_MEMORY;
            if (!write) {
                cmd->sink = host + done;
                cmd->sink_len = len;
            }
            cl_int err = am_op_submit(&op->base, cmd, row + 1 == rows && done + len == width);
            if (err != CL_SUCCESS)
                return err;
            done += len;
        }
    }
    return CL_SUCCESS;
}

static cl_int run_rect(am_op *base, bool write) {
    rect_op *op = (rect_op *)base;
    size_t packed_size = am_rect_packed_size(&op->buffer);
    if (packed_size > am_session_chunk(base->queue->context->session))
        return run_rect_rows(op, write);
    uint8_t *packed = malloc(packed_size);
    if (packed == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    if (write)
        am_rect_pack(&op->host, op->host_base, packed);
    am_buf fields;
    am_buf_init(&fields);
    rect_fields(&fields, op->mem->handle, &op->buffer);
    char *text = am_buf_take(&fields);
    am_cmd *cmd = text != NULL ? am_op_cmd(base, write ? "write_rect" : "read_rect", text, write ? packed : NULL,
                                           write ? packed_size : 0, write, true)
                               : NULL;
    free(text);
    if (cmd == NULL) {
        if (!write)
            free(packed);
        return CL_OUT_OF_HOST_MEMORY;
    }
    if (!write) {
        cmd->sink = packed;
        cmd->sink_len = packed_size;
        if (!am_op_cmd_keep(cmd, NULL, &op->host, op->host_base, packed)) {
            am_cmd_free(cmd);
            return CL_OUT_OF_HOST_MEMORY;
        }
    }
    return am_op_submit(base, cmd, true);
}

static cl_int run_write_rect(am_op *op) {
    return run_rect(op, true);
}

static cl_int run_read_rect(am_op *op) {
    return run_rect(op, false);
}

static cl_int enqueue_rect(cl_command_queue queue, cl_mem mem, bool write, cl_bool blocking, const size_t *buffer_origin,
                           const size_t *host_origin, const size_t *region, size_t buffer_row_pitch,
                           size_t buffer_slice_pitch, size_t host_row_pitch, size_t host_slice_pitch, void *ptr,
                           cl_uint num_waits, const cl_event *waits, cl_event *event) {
    cl_int err = check_queue_mem(queue, mem);
    if (err != CL_SUCCESS)
        return err;
    if (ptr == NULL || buffer_origin == NULL || host_origin == NULL || region == NULL)
        return CL_INVALID_VALUE;
    am_rect buffer, host;
    if (am_rect_make(&buffer, buffer_origin, region, buffer_row_pitch, buffer_slice_pitch) != CL_SUCCESS ||
        am_rect_make(&host, host_origin, region, host_row_pitch, host_slice_pitch) != CL_SUCCESS ||
        buffer.extent > mem->size)
        return CL_INVALID_VALUE;
    if (write ? !host_may_write(mem) : !host_may_read(mem))
        return CL_INVALID_OPERATION;
    am_op *base;
    err = am_op_new(queue, sizeof(rect_op), write ? CL_COMMAND_WRITE_BUFFER_RECT : CL_COMMAND_READ_BUFFER_RECT,
                    num_waits, waits, &base);
    if (err != CL_SUCCESS)
        return err;
    rect_op *op = (rect_op *)base;
    am_mem_retain(mem);
    op->mem = mem;
    op->buffer = buffer;
    op->host = host;
    op->host_base = ptr;
    base->run = write ? run_write_rect : run_read_rect;
    base->release = release_rect;
    /* (a write waits too: its bytes are packed when it runs, from the caller's memory) */
    return am_op_enqueue(base, event, blocking);
}

static cl_int CL_API_CALL am_clEnqueueWriteBufferRect(cl_command_queue queue, cl_mem mem, cl_bool blocking,
                                                      const size_t *buffer_origin, const size_t *host_origin,
                                                      const size_t *region, size_t buffer_row_pitch,
                                                      size_t buffer_slice_pitch, size_t host_row_pitch,
                                                      size_t host_slice_pitch, const void *ptr, cl_uint num_waits,
                                                      const cl_event *waits, cl_event *event) {
    return enqueue_rect(queue, mem, true, blocking, buffer_origin, host_origin, region, buffer_row_pitch,
                        buffer_slice_pitch, host_row_pitch, host_slice_pitch, (void *)ptr, num_waits, waits, event);
}

static cl_int CL_API_CALL am_clEnqueueReadBufferRect(cl_command_queue queue, cl_mem mem, cl_bool blocking,
                                                     const size_t *buffer_origin, const size_t *host_origin,
                                                     const size_t *region, size_t buffer_row_pitch,
                                                     size_t buffer_slice_pitch, size_t host_row_pitch,
                                                     size_t host_slice_pitch, void *ptr, cl_uint num_waits,
                                                     const cl_event *waits, cl_event *event) {
    return enqueue_rect(queue, mem, false, blocking, buffer_origin, host_origin, region, buffer_row_pitch,
                        buffer_slice_pitch, host_row_pitch, host_slice_pitch, ptr, num_waits, waits, event);
}

static cl_int CL_API_CALL am_clEnqueueCopyBufferRect(cl_command_queue queue, cl_mem src, cl_mem dst,
                                                     const size_t *src_origin, const size_t *dst_origin,
                                                     const size_t *region, size_t src_row_pitch,
                                                     size_t src_slice_pitch, size_t dst_row_pitch,
                                                     size_t dst_slice_pitch, cl_uint num_waits, const cl_event *waits,
                                                     cl_event *event) {
    cl_int err = check_queue_mem(queue, src);
    if (err == CL_SUCCESS)
        err = check_queue_mem(queue, dst);
    if (err != CL_SUCCESS)
        return err;
    if (src_origin == NULL || dst_origin == NULL || region == NULL)
        return CL_INVALID_VALUE;
    am_rect s, d;
    if (am_rect_make(&s, src_origin, region, src_row_pitch, src_slice_pitch) != CL_SUCCESS ||
        am_rect_make(&d, dst_origin, region, dst_row_pitch, dst_slice_pitch) != CL_SUCCESS || s.extent > src->size ||
        d.extent > dst->size)
        return CL_INVALID_VALUE;
    if (am_mem_root(src) == am_mem_root(dst)) {
        if (src == dst && s.row_pitch != d.row_pitch && s.slice_pitch != d.slice_pitch)
            return CL_INVALID_VALUE;
        /* compare in the root buffer's bytes */
        am_rect sr = s, dr = d;
        sr.offset += src->origin, sr.extent += src->origin;
        dr.offset += dst->origin, dr.extent += dst->origin;
        if (src == dst ? am_rect_overlap(&sr, &dr) : !(dr.extent <= sr.offset || sr.extent <= dr.offset))
            return CL_MEM_COPY_OVERLAP;
    }
    am_buf fields;
    am_buf_init(&fields);
    am_buf_printf(&fields, "\"src\":%" PRIu64 ",\"dst\":%" PRIu64 ",\"src_origin\":[%zu,%zu,%zu],"
                  "\"dst_origin\":[%zu,%zu,%zu],\"region\":[%zu,%zu,%zu],\"src_row_pitch\":%zu,\"src_slice_pitch\":%zu,"
                  "\"dst_row_pitch\":%zu,\"dst_slice_pitch\":%zu", src->handle, dst->handle, s.origin[0], s.origin[1],
                  s.origin[2], d.origin[0], d.origin[1], d.origin[2], region[0], region[1], region[2], s.row_pitch,
                  s.slice_pitch, d.row_pitch, d.slice_pitch);
    return enqueue_device_op(queue, CL_COMMAND_COPY_BUFFER_RECT, "copy_rect", am_buf_take(&fields), src, dst,
                             num_waits, waits, event);
}

/* -- maps ------------------------------------------------------------------------------ */

/* The host memory a buffer maps to: the application's (USE_HOST_PTR) or a
 * mirror of the root buffer made at the first map. */
static uint8_t *map_base(cl_mem mem) {
    cl_mem root = am_mem_root(mem);
    if (root->host_ptr != NULL)
        return (uint8_t *)root->host_ptr + mem->origin;
    pthread_mutex_lock(&root->mu);
    if (root->mirror == NULL)
        root->mirror = calloc(1, root->size);
    uint8_t *base = root->mirror;
    pthread_mutex_unlock(&root->mu);
    return base != NULL ? base + mem->origin : NULL;
}

static cl_int run_map_read(am_op *op) {
    return run_transfer((transfer_op *)op, false);
}

static void *CL_API_CALL am_clEnqueueMapBuffer(cl_command_queue queue, cl_mem mem, cl_bool blocking,
                                               cl_map_flags flags, size_t offset, size_t size, cl_uint num_waits,
                                               const cl_event *waits, cl_event *event, cl_int *errcode) {
    cl_int err = check_queue_mem(queue, mem);
    void *ptr = NULL;
    const cl_map_flags known = CL_MAP_READ | CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION;
    if (err != CL_SUCCESS)
        goto out;
    if ((flags & ~known) || ((flags & CL_MAP_WRITE_INVALIDATE_REGION) && (flags & (CL_MAP_READ | CL_MAP_WRITE))) ||
        check_range(mem, offset, size) != CL_SUCCESS) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    if (((flags & CL_MAP_READ) && !host_may_read(mem)) ||
        ((flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION)) && !host_may_write(mem))) {
        err = CL_INVALID_OPERATION;
        goto out;
    }
    uint8_t *base = map_base(mem);
    am_mapping *mapping = base != NULL ? calloc(1, sizeof *mapping) : NULL;
    if (mapping == NULL) {
        err = CL_MAP_FAILURE;
        goto out;
    }
    ptr = base + offset;
    mapping->ptr = ptr;
    mapping->offset = offset;
    mapping->size = size;
    mapping->flags = flags;
    if (flags & CL_MAP_WRITE_INVALIDATE_REGION) {
        err = am_enqueue_marker(queue, CL_COMMAND_MAP_BUFFER, num_waits, waits, event, blocking);
    } else {
        transfer_op *op;
        err = new_transfer(queue, mem, CL_COMMAND_MAP_BUFFER, offset, size, ptr, num_waits, waits, &op);
        if (err == CL_SUCCESS) {
            op->keep = am_mem_root(mem);
            op->base.run = run_map_read;
            err = am_op_enqueue(&op->base, event, blocking);
        }
    }
    if (err != CL_SUCCESS) {
        free(mapping);
        ptr = NULL;
        goto out;
    }
    pthread_mutex_lock(&mem->mu);
    mapping->next = mem->mappings;
    mem->mappings = mapping;
    mem->map_count++;
    pthread_mutex_unlock(&mem->mu);
out:
    if (errcode != NULL)
        *errcode = err;
    return ptr;
}

static cl_int run_unmap_write(am_op *op) {
    return run_transfer((transfer_op *)op, true);
}

static cl_int CL_API_CALL am_clEnqueueUnmapMemObject(cl_command_queue queue, cl_mem mem, void *ptr, cl_uint num_waits,
                                                     const cl_event *waits, cl_event *event) {
    cl_int err = check_queue_mem(queue, mem);
    if (err != CL_SUCCESS)
        return err;
    pthread_mutex_lock(&mem->mu);
    am_mapping **at = &mem->mappings;
    while (*at != NULL && (*at)->ptr != ptr)
        at = &(*at)->next;
    am_mapping *mapping = *at;
    if (mapping != NULL) {
        *at = mapping->next;
        mem->map_count--;
    }
    pthread_mutex_unlock(&mem->mu);
    if (mapping == NULL)
        return CL_INVALID_VALUE;
    bool write_back = (mapping->flags & (CL_MAP_WRITE | CL_MAP_WRITE_INVALIDATE_REGION)) != 0;
    size_t offset = mapping->offset, size = mapping->size;
    free(mapping);
    if (!write_back) {
        return am_enqueue_marker(queue, CL_COMMAND_UNMAP_MEM_OBJECT, num_waits, waits, event, false);
    }
    transfer_op *op;
    err = new_transfer(queue, mem, CL_COMMAND_UNMAP_MEM_OBJECT, offset, size, ptr, num_waits, waits, &op);
    if (err != CL_SUCCESS)
        return err;
    op->keep = am_mem_root(mem); /* (the mirror the bytes are sent from) */
    op->base.run = run_unmap_write;
    return am_op_enqueue(&op->base, event, false);
}

static cl_int CL_API_CALL am_clEnqueueMigrateMemObjects(cl_command_queue queue, cl_uint num, const cl_mem *mems,
                                                        cl_mem_migration_flags flags, cl_uint num_waits,
                                                        const cl_event *waits, cl_event *event) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    if (num == 0 || mems == NULL ||
        (flags & ~(cl_mem_migration_flags)(CL_MIGRATE_MEM_OBJECT_HOST | CL_MIGRATE_MEM_OBJECT_CONTENT_UNDEFINED)))
        return CL_INVALID_VALUE;
    for (cl_uint i = 0; i < num; i++) {
        cl_int err = check_queue_mem(queue, mems[i]);
        if (err != CL_SUCCESS)
            return err;
    }
    /* one device, the buffers live there: nothing moves */
    return am_enqueue_marker(queue, CL_COMMAND_MIGRATE_MEM_OBJECTS, num_waits, waits, event, false);
}

/* -- launches ------------------------------------------------------------------------------ */

typedef struct launch_op {
    am_op base;
    cl_kernel kernel;     /* retained */
    cl_mem *mems;         /* retained: the buffers its arguments name (for as long as it may wait) */
    size_t num_mems;
    char *fields;         /* owned */
} launch_op;

static void release_launch(am_op *base) {
    launch_op *op = (launch_op *)base;
    for (size_t i = 0; i < op->num_mems; i++)
        am_mem_release(op->mems[i]);
    free(op->mems);
    free(op->fields);
    am_kernel_release(op->kernel);
}

static cl_int run_launch(am_op *base) {
    launch_op *op = (launch_op *)base;
    am_cmd *cmd = am_op_cmd(base, "launch", op->fields, NULL, 0, false, false);
    if (cmd == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    return am_op_submit(base, cmd, true);
}

static cl_int check_work(cl_kernel kernel, cl_command_queue queue, cl_uint dims, const size_t *offset,
                         const size_t *global, const size_t *local) {
    cl_device_id device = queue->device;
    if (dims < 1 || dims > 3)
        return CL_INVALID_WORK_DIMENSION;
    if (global == NULL)
        return CL_INVALID_GLOBAL_WORK_SIZE;
    for (cl_uint i = 0; i < dims; i++)
        if (global[i] == 0 || global[i] > (size_t)INT64_MAX)
            return CL_INVALID_GLOBAL_WORK_SIZE;
    if (offset != NULL)
        for (cl_uint i = 0; i < dims; i++) {
            if (offset[i] > (size_t)INT64_MAX - global[i])
                return CL_INVALID_GLOBAL_OFFSET;
            if (offset[i] != 0 && am_session_version(queue->context->session) < AM_PROTOCOL_OFFSET) {
                am_warn("clEnqueueNDRangeKernel: the pool speaks data-plane protocol %u, without global work "
                        "offsets (they need %d: upgrade the pool)", am_session_version(queue->context->session),
                        AM_PROTOCOL_OFFSET);
                return CL_INVALID_GLOBAL_OFFSET;
            }
        }
    bool required = kernel->compile_size[0] != 0;
    if (local == NULL)
        return required ? CL_INVALID_WORK_GROUP_SIZE : CL_SUCCESS;
    size_t max_sizes[3] = {0};
    const am_param_value *sizes = am_devparams_get(&device->params, CL_DEVICE_MAX_WORK_ITEM_SIZES);
    if (sizes != NULL)
        memcpy(max_sizes, sizes->bytes, sizes->len < sizeof max_sizes ? sizes->len : sizeof max_sizes);
    size_t product = 1;
    for (cl_uint i = 0; i < dims; i++) {
        if (local[i] == 0)
            return CL_INVALID_WORK_GROUP_SIZE;
        if (max_sizes[i] != 0 && local[i] > max_sizes[i])
            return CL_INVALID_WORK_ITEM_SIZE;
        if (global[i] % local[i] != 0) /* (uniform work-groups: the devices say no other) */
            return CL_INVALID_WORK_GROUP_SIZE;
        if (required && local[i] != kernel->compile_size[i])
            return CL_INVALID_WORK_GROUP_SIZE;
        product *= local[i];
    }
    if (product > kernel->wg_size || product > am_device_uint(device, CL_DEVICE_MAX_WORK_GROUP_SIZE))
        return CL_INVALID_WORK_GROUP_SIZE;
    return CL_SUCCESS;
}

static void sizes_json(am_buf *out, const char *key, cl_uint dims, const size_t *values) {
    am_buf_printf(out, ",\"%s\":[", key);
    for (cl_uint i = 0; i < dims; i++)
        am_buf_printf(out, "%s%zu", i ? "," : "", values[i]);
    am_buf_puts(out, "]");
}

static cl_int CL_API_CALL am_clEnqueueNDRangeKernel(cl_command_queue queue, cl_kernel kernel, cl_uint dims,
                                                    const size_t *offset, const size_t *global, const size_t *local,
                                                    cl_uint num_waits, const cl_event *waits, cl_event *event) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    cl_program program = kernel->program;
    if (program->context != queue->context)
        return CL_INVALID_CONTEXT;
    cl_int err = check_work(kernel, queue, dims, offset, global, local);
    if (err != CL_SUCCESS)
        return err;
    am_op *base;
    if ((err = am_op_new(queue, sizeof(launch_op), CL_COMMAND_NDRANGE_KERNEL, num_waits, waits, &base)) != CL_SUCCESS)
        return err;
    launch_op *op = (launch_op *)base;
    am_kernel_retain(kernel);
    op->kernel = kernel;
    base->run = run_launch;
    base->release = release_launch;
    am_buf fields;
    am_buf_init(&fields);
    int rc = am_buf_printf(&fields, "\"prog\":%" PRIu64 ",\"kernel\":", program->handle);
    rc |= am_buf_json_string(&fields, kernel->name, strlen(kernel->name));
    sizes_json(&fields, "gsize", dims, global);
    if (local != NULL)
        sizes_json(&fields, "lsize", dims, local);
    bool offset_given = false;
    for (cl_uint i = 0; offset != NULL && i < dims; i++)
        offset_given |= offset[i] != 0;
    if (offset_given) /* (protocol 4: checked above) */
        sizes_json(&fields, "goffset", dims, offset);
    rc |= am_buf_puts(&fields, ",\"args\":[");
    pthread_mutex_lock(&kernel->mu);
    op->mems = calloc(kernel->num_args ? kernel->num_args : 1, sizeof *op->mems);
    if (op->mems == NULL)
        err = CL_OUT_OF_HOST_MEMORY;
    for (cl_uint i = 0; err == CL_SUCCESS && i < kernel->num_args; i++) {
        const am_arg *arg = &kernel->args[i];
        rc |= am_buf_puts(&fields, i ? "," : "");
        switch (arg->kind) {
        case AM_ARG_UNSET:
            err = CL_INVALID_KERNEL_ARGS;
            break;
        case AM_ARG_BUFFER:
            if (!am_is_mem(arg->mem)) {
                err = CL_INVALID_KERNEL_ARGS; /* (released since it was set) */
                break;
            }
            if (atomic_load(&arg->mem->alloc_error) != 0) {
                err = atomic_load(&arg->mem->alloc_error);
                break;
            }
            am_mem_retain(arg->mem);
            op->mems[op->num_mems++] = arg->mem;
            rc |= am_buf_printf(&fields, "{\"buf\":%" PRIu64 "}", arg->mem->handle);
            break;
        case AM_ARG_NULL:
            rc |= am_buf_puts(&fields, "{\"buf\":null}");
            break;
        case AM_ARG_LOCAL:
            rc |= am_buf_printf(&fields, "{\"local\":%zu}", arg->size);
            break;
        case AM_ARG_RAW: {
            const uint8_t *bytes = arg->big != NULL ? arg->big : arg->raw;
            rc |= am_buf_puts(&fields, "{\"raw\":\"");
            for (size_t k = 0; k < arg->size; k++)
                rc |= am_buf_printf(&fields, "%02x", bytes[k]);
            rc |= am_buf_puts(&fields, "\"}");
            break;
        }
        }
    }
    pthread_mutex_unlock(&kernel->mu);
    rc |= am_buf_puts(&fields, "]");
    if (err == CL_SUCCESS && rc != 0)
        err = CL_OUT_OF_HOST_MEMORY;
    if (err != CL_SUCCESS) {
        am_buf_free(&fields);
        am_op_free(base);
        return err;
    }
    op->fields = am_buf_take(&fields);
    return am_op_enqueue(base, event, false);
}

static cl_int CL_API_CALL am_clEnqueueTask(cl_command_queue queue, cl_kernel kernel, cl_uint num_waits,
                                           const cl_event *waits, cl_event *event) {
    static const size_t one[1] = {1};
    return am_clEnqueueNDRangeKernel(queue, kernel, 1, NULL, one, one, num_waits, waits, event);
}

static cl_int CL_API_CALL am_clEnqueueNativeKernel(cl_command_queue queue, void(CL_CALLBACK *fn)(void *), void *args,
                                                   size_t size, cl_uint num_mems, const cl_mem *mems,
                                                   const void **locs, cl_uint num_waits, const cl_event *waits,
                                                   cl_event *event) {
    (void)fn, (void)args, (void)size, (void)num_mems, (void)mems, (void)locs, (void)num_waits, (void)waits,
        (void)event;
    /* the devices run no native kernels here (CL_EXEC_NATIVE_KERNEL is not offered) */
    return am_is_queue(queue) ? CL_INVALID_OPERATION : CL_INVALID_COMMAND_QUEUE;
}

void am_enqueue_functions(cl_icd_dispatch *d);
void am_enqueue_functions(cl_icd_dispatch *d) {
    d->clEnqueueReadBuffer = am_clEnqueueReadBuffer;
    d->clEnqueueWriteBuffer = am_clEnqueueWriteBuffer;
    d->clEnqueueCopyBuffer = am_clEnqueueCopyBuffer;
    d->clEnqueueFillBuffer = am_clEnqueueFillBuffer;
    d->clEnqueueReadBufferRect = am_clEnqueueReadBufferRect;
    d->clEnqueueWriteBufferRect = am_clEnqueueWriteBufferRect;
    d->clEnqueueCopyBufferRect = am_clEnqueueCopyBufferRect;
    d->clEnqueueMapBuffer = am_clEnqueueMapBuffer;
    d->clEnqueueUnmapMemObject = am_clEnqueueUnmapMemObject;
    d->clEnqueueMigrateMemObjects = am_clEnqueueMigrateMemObjects;
    d->clEnqueueNDRangeKernel = am_clEnqueueNDRangeKernel;
    d->clEnqueueTask = am_clEnqueueTask;
    d->clEnqueueNativeKernel = am_clEnqueueNativeKernel;
}

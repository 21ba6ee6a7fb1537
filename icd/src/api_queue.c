/* Command queues and the way an enqueued operation reaches the session.
 *
 * Every queue of a context feeds the context's one session, whose
 * commands run in order at the pool: so an in-order queue is kept in
 * order by construction, an out-of-order queue is accepted and executed
 * in order (a valid schedule), and a command that waits for a command of
 * another queue of the context waits for one sent before it.  What cannot
 * be sent yet is an operation whose wait list holds a user event not set,
 * or a command still held: it is *held* in its queue, and every later
 * operation of that queue with it, until clSetUserEventStatus lets them go
 * (am_ctx_release_held).  An operation whose wait list holds a failed
 * event fails with CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST and sends
 * nothing. */
#include <stdlib.h>
#include <string.h>

#include "icd.h"
#include "json.h"
#include "log.h"

bool am_is_queue(cl_command_queue queue) {
    return queue != NULL && queue->magic == AM_MAGIC_QUEUE;
}

void am_queue_retain(cl_command_queue queue) {
    atomic_fetch_add(&queue->refs, 1);
}

void am_queue_release(cl_command_queue queue) {
    if (atomic_fetch_sub(&queue->refs, 1) != 1)
        return;
    cl_context ctx = queue->context;
    am_ctx_remove_queue(ctx, queue);
    queue->magic = AM_MAGIC_DEAD;
    pthread_mutex_destroy(&queue->submit_mu);
    free(queue);
    am_ctx_release(ctx);
}

/* -- operations ------------------------------------------------------------------------- */

cl_int am_op_new(cl_command_queue queue, size_t size, cl_command_type type, cl_uint num_waits,
                 const cl_event *waits, am_op **out) {
    cl_int err = am_check_wait_list(queue->context, num_waits, waits);
    if (err != CL_SUCCESS)
        return err;
    am_op *op = calloc(1, size);
    if (op == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    op->queue = queue;
    op->event = am_event_new(queue->context, queue, type);
    if (num_waits)
        op->waits = malloc(num_waits * sizeof *op->waits);
    if (op->event == NULL || (num_waits && op->waits == NULL)) {
        if (op->event != NULL)
            am_event_release(op->event);
        free(op->waits);
        free(op);
        return CL_OUT_OF_HOST_MEMORY;
    }
    for (cl_uint i = 0; i < num_waits; i++) {
        am_event_retain(waits[i]);
        op->waits[i] = waits[i];
    }
    op->num_waits = num_waits;
    *out = op;
    return CL_SUCCESS;
}

void am_op_free(am_op *op) {
    if (op->release != NULL)
        op->release(op);
    for (cl_uint i = 0; i < op->num_waits; i++)
        am_event_release(op->waits[i]);
    free(op->waits);
    am_event_release(op->event);
    free(op);
}

enum readiness { WAITS, READY, WAIT_FAILED };

/* Whether an operation's wait list lets it go (ctx->mu held). */
static enum readiness readiness_locked(const am_op *op) {
    enum readiness result = READY;
    for (cl_uint i = 0; i < op->num_waits; i++) {
        cl_event wait = op->waits[i];
        if (wait->status < 0)
            return WAIT_FAILED;
        /* a user event: once set; a command: once sent (it runs before) */
        bool ready = wait->user ? wait->status <= CL_COMPLETE : wait->status <= CL_SUBMITTED;
        if (!ready)
            result = WAITS;
    }
    return result;
}

/* Run an operation whose time has come (the queue's submit_mu held). */
static void run_now(am_op *op, enum readiness readiness, cl_int *rc) {
    cl_int err = readiness == WAIT_FAILED ? CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST : op->run(op);
    if (err != CL_SUCCESS)
        am_event_set_status(op->event, err);
    if (rc != NULL)
        *rc = err;
}

cl_int am_op_enqueue(am_op *op, cl_event *event_out, bool blocking) {
    cl_command_queue queue = op->queue;
    cl_context ctx = queue->context;
    cl_event event = op->event;
    am_event_retain(event); /* ours until the end of this call */
    cl_int rc = CL_SUCCESS;
    pthread_mutex_lock(&queue->submit_mu);
    pthread_mutex_lock(&ctx->mu);
    enum readiness readiness = queue->held != NULL ? WAITS : readiness_locked(op);
    if (readiness == WAITS) {
        op->next = NULL;
        if (queue->held_tail != NULL)
            queue->held_tail->next = op;
        else
            queue->held = op;
        queue->held_tail = op;
        op = NULL; /* the queue's now */
    }
    pthread_mutex_unlock(&ctx->mu);
    if (op != NULL)
        run_now(op, readiness, &rc);
    pthread_mutex_unlock(&queue->submit_mu);
    if (op != NULL) {
        am_op_free(op);
        am_ctx_release_held(ctx); /* (what waited for this one's command may go) */
    }
    if (rc == CL_SUCCESS && blocking) {
        rc = am_events_wait(1, &event);
        if (rc == CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST) {
            pthread_mutex_lock(&ctx->mu);
            rc = event->status;
            pthread_mutex_unlock(&ctx->mu);
        }
    }
    if (event_out != NULL && rc == CL_SUCCESS)
        *event_out = event; /* (our reference becomes the application's) */
    else
        am_event_release(event);
    return rc;
}

void am_ctx_release_held(cl_context ctx) {
    for (bool progress = true; progress;) {
        progress = false;
        pthread_mutex_lock(&ctx->mu);
        size_t count = 0;
        for (size_t i = 0; i < ctx->num_queues; i++)
            count += ctx->queues[i]->held != NULL;
        if (count == 0) { /* (the common case: nothing held anywhere) */
            pthread_mutex_unlock(&ctx->mu);
            return;
        }
        cl_command_queue *queues = malloc(count * sizeof *queues);
        size_t held = 0;
        for (size_t i = 0; queues != NULL && i < ctx->num_queues; i++)
            if (ctx->queues[i]->held != NULL) {
                am_queue_retain(ctx->queues[i]);
                queues[held++] = ctx->queues[i];
            }
        pthread_mutex_unlock(&ctx->mu);
        for (size_t i = 0; i < held; i++) {
            cl_command_queue queue = queues[i];
            pthread_mutex_lock(&queue->submit_mu);
            for (;;) {
                pthread_mutex_lock(&ctx->mu);
                am_op *op = queue->held;
                enum readiness readiness = op != NULL ? readiness_locked(op) : WAITS;
                if (op == NULL || readiness == WAITS) {
                    pthread_mutex_unlock(&ctx->mu);
                    break;
                }
                queue->held = op->next;
                if (queue->held == NULL)
                    queue->held_tail = NULL;
                pthread_mutex_unlock(&ctx->mu);
                run_now(op, readiness, NULL);
                am_op_free(op);
                progress = true;
            }
            pthread_mutex_unlock(&queue->submit_mu);
            am_queue_release(queue);
        }
        free(queues);
    }
}

/* -- commands of an operation --------------------------------------------------------- */

static const char *const PROFILED_OPS[] = {"launch", "write", "read", "copy", "fill", "write_rect", "read_rect",
                                           "copy_rect"};

static bool profiled_op(const char *op) {
    for (size_t i = 0; i < sizeof PROFILED_OPS / sizeof *PROFILED_OPS; i++)
        if (strcmp(op, PROFILED_OPS[i]) == 0)
            return true;
    return false;
}

/* A command of an op has answered: its event moves on (I/O thread). */
static void op_cmd_answered(am_cmd *cmd, void *arg) {
    cl_event event = arg;
    cl_context ctx = event->context;
    pthread_mutex_lock(&ctx->mu);
    if (!cmd->ok) {
        am_event_set_status_locked(event, am_error_to_cl(&cmd->error, CL_OUT_OF_RESOURCES));
    } else {
        json_object *times = cmd->reply != NULL ? am_json_get(cmd->reply, "times") : NULL;
        uint64_t t[4];
        bool have = times != NULL && json_object_is_type(times, json_type_array) &&
                    json_object_array_length(times) == 4;
        for (size_t i = 0; have && i < 4; i++)
            have = am_json_u64(json_object_array_get_idx(times, i), &t[i]);
        if (have && event->profiled) {
            if (!event->have_times)
                for (int i = 0; i < 3; i++)
                    event->times[i] = t[i];
            event->times[3] = t[3];
            event->have_times = true;
            if (t[3] > ctx->last_end_ns)
                ctx->last_end_ns = t[3];
        }
        am_event_set_status_locked(event, CL_RUNNING);
    }
    pthread_mutex_unlock(&ctx->mu);
    am_event_release(event);
}

typedef struct kept {
    cl_event event;   /* (the reference the hook had) */
    cl_mem mem;       /* retained */
    am_rect host;
    uint8_t *base;
    uint8_t *packed;  /* owned */
} kept;

static void kept_answered(am_cmd *cmd, void *arg) {
    kept *k = arg;
    if (cmd->ok && k->packed != NULL)
        am_rect_unpack(&k->host, k->base, k->packed);
    free(k->packed);
    if (k->mem != NULL)
        am_mem_release(k->mem);
    op_cmd_answered(cmd, k->event);
    free(k);
}

bool am_op_cmd_keep(am_cmd *cmd, cl_mem mem, const am_rect *host, uint8_t *base, uint8_t *packed) {
    kept *k = calloc(1, sizeof *k);
    if (k == NULL) {
        free(packed);
        return false;
    }
    k->event = cmd->hook_ctx;
    k->mem = mem;
    if (mem != NULL)
        am_mem_retain(mem);
    if (host != NULL)
        k->host = *host;
    k->base = base;
    k->packed = packed;
    cmd->on_reply = kept_answered;
    cmd->hook_ctx = k;
    return true;
}

am_cmd *am_op_cmd(am_op *op, const char *wire_op, const char *fields, const void *payload, uint64_t len,
                  bool owned, bool completes) {
    am_buf text;
    am_buf_init(&text);
    if (am_buf_puts(&text, fields) != 0 ||
        (op->event->profiled && profiled_op(wire_op) && am_buf_puts(&text, fields[0] ? ",\"prof\":true"
                                                                                        : "\"prof\":true") != 0)) {
        am_buf_free(&text);
        if (owned)
            free((void *)payload);
        return NULL;
    }
    am_cmd *cmd = am_cmd_new(wire_op, text.data != NULL ? (const char *)text.data : "", payload, len, owned);
    am_buf_free(&text);
    if (cmd == NULL) {
        if (owned)
            free((void *)payload);
        return NULL;
    }
    cmd->completes = completes;
    cmd->on_reply = op_cmd_answered;
    cmd->hook_ctx = op->event;
    am_event_retain(op->event);
    return cmd;
}

cl_int am_op_submit(am_op *op, am_cmd *cmd, bool last) {
    cl_context ctx = op->queue->context;
    am_error err;
    uint64_t seq;
    if (am_session_submit(ctx->session, cmd, &seq, &err) != 0) {
        /* its hook runs now, with the failure: what it holds goes, the event says why */
        cmd->ok = false;
        cmd->error = err;
        cmd->on_reply(cmd, cmd->hook_ctx);
        am_cmd_free(cmd);
        return am_error_to_cl(&err, CL_OUT_OF_RESOURCES);
    }
    if (last) {
        /* (cmd may be answered and freed already: only its number is used) */
        pthread_mutex_lock(&ctx->mu);
        op->event->seq = seq;
        am_event_set_status_locked(op->event, CL_SUBMITTED);
        am_ctx_watch_locked(ctx, op->event, op->event->seq);
        pthread_mutex_unlock(&ctx->mu);
    }
    return CL_SUCCESS;
}

/* -- queues ---------------------------------------------------------------------------- */

static cl_command_queue make_queue(cl_context ctx, cl_device_id device, cl_command_queue_properties props,
                                   const cl_queue_properties *array, size_t array_len, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_command_queue queue = NULL;
    const cl_command_queue_properties known = CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE | CL_QUEUE_PROFILING_ENABLE |
                                              CL_QUEUE_ON_DEVICE | CL_QUEUE_ON_DEVICE_DEFAULT;
    if (!am_is_context(ctx))
        err = CL_INVALID_CONTEXT;
    else if (device != ctx->device)
        err = CL_INVALID_DEVICE;
    else if (props & ~known)
        err = CL_INVALID_VALUE;
    else if (props & (CL_QUEUE_ON_DEVICE | CL_QUEUE_ON_DEVICE_DEFAULT))
        err = CL_INVALID_QUEUE_PROPERTIES; /* no device-side enqueue */
    else if ((queue = calloc(1, sizeof *queue)) == NULL)
        err = CL_OUT_OF_HOST_MEMORY;
    if (err == CL_SUCCESS) {
        queue->dispatch = &am_dispatch;
        queue->magic = AM_MAGIC_QUEUE;
        atomic_init(&queue->refs, 1);
        queue->context = ctx;
        am_ctx_retain(ctx);
        queue->device = device;
        queue->properties = props;
        if (array_len)
            memcpy(queue->props_array, array, array_len * sizeof *array);
        queue->props_array_len = array_len;
        pthread_mutex_init(&queue->submit_mu, NULL);
        am_ctx_add_queue(ctx, queue);
    }
    if (errcode != NULL)
        *errcode = err;
    return queue;
}

static cl_command_queue CL_API_CALL am_clCreateCommandQueue(cl_context ctx, cl_device_id device,
                                                            cl_command_queue_properties props, cl_int *errcode) {
    return make_queue(ctx, device, props, NULL, 0, errcode);
}

static cl_command_queue CL_API_CALL am_clCreateCommandQueueWithProperties(cl_context ctx, cl_device_id device,
                                                                          const cl_queue_properties *props,
                                                                          cl_int *errcode) {
    cl_command_queue_properties flags = 0;
    size_t len = 0;
    if (props != NULL) {
        for (; props[len] != 0; len += 2) {
            if (len + 3 > sizeof ((struct _cl_command_queue *)0)->props_array / sizeof(cl_queue_properties)) {
                if (errcode != NULL)
                    *errcode = CL_INVALID_VALUE;
                return NULL;
            }
            if (props[len] == CL_QUEUE_PROPERTIES) {
                flags = (cl_command_queue_properties)props[len + 1];
            } else if (props[len] == CL_QUEUE_SIZE) {
                if (errcode != NULL)
                    *errcode = CL_INVALID_QUEUE_PROPERTIES; /* device queues only */
                return NULL;
            } else {
                if (errcode != NULL)
                    *errcode = CL_INVALID_VALUE;
                return NULL;
            }
        }
        len++;
    }
    return make_queue(ctx, device, flags, props, len, errcode);
}

static cl_int CL_API_CALL am_clRetainCommandQueue(cl_command_queue queue) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    am_queue_retain(queue);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseCommandQueue(cl_command_queue queue) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    am_queue_release(queue); /* (its commands are sent already: the implicit flush) */
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clGetCommandQueueInfo(cl_command_queue queue, cl_command_queue_info param,
                                                   size_t size, void *value, size_t *size_ret) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    switch (param) {
    case CL_QUEUE_CONTEXT:
        return am_answer(size, value, size_ret, &queue->context, sizeof queue->context);
    case CL_QUEUE_DEVICE:
        return am_answer(size, value, size_ret, &queue->device, sizeof queue->device);
    case CL_QUEUE_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&queue->refs);
        return am_answer(size, value, size_ret, &refs, sizeof refs);
    }
    case CL_QUEUE_PROPERTIES:
        return am_answer(size, value, size_ret, &queue->properties, sizeof queue->properties);
    case CL_QUEUE_PROPERTIES_ARRAY:
        return am_answer(size, value, size_ret, queue->props_array,
                       queue->props_array_len * sizeof *queue->props_array);
    case CL_QUEUE_DEVICE_DEFAULT: {
        cl_command_queue none = NULL;
        return am_answer(size, value, size_ret, &none, sizeof none);
    }
    case CL_QUEUE_SIZE:
        return CL_INVALID_COMMAND_QUEUE; /* a host queue has none */
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_int CL_API_CALL am_clSetCommandQueueProperty(cl_command_queue queue, cl_command_queue_properties props,
                                                       cl_bool enable, cl_command_queue_properties *old) {
    (void)props, (void)enable, (void)old;
    return am_is_queue(queue) ? CL_INVALID_OPERATION : CL_INVALID_COMMAND_QUEUE;
}

/* Markers and barriers: nothing at the pool; their event completes with
 * every command sent before it (the session's commands run in order). */
static cl_int run_marker(am_op *op) {
    cl_context ctx = op->queue->context;
    uint64_t seq = am_session_last_seq(ctx->session);
    pthread_mutex_lock(&ctx->mu);
    op->event->seq = seq;
    am_event_set_status_locked(op->event, CL_SUBMITTED);
    if (seq == 0)
        am_event_set_status_locked(op->event, CL_COMPLETE);
    else
        am_ctx_watch_locked(ctx, op->event, seq);
    pthread_mutex_unlock(&ctx->mu);
    return CL_SUCCESS;
}

cl_int am_enqueue_marker(cl_command_queue queue, cl_command_type type, cl_uint num_waits, const cl_event *waits,
                         cl_event *event, bool blocking) {
    if (!am_is_queue(queue))
        return CL_INVALID_COMMAND_QUEUE;
    am_op *op;
    cl_int err = am_op_new(queue, sizeof *op, type, num_waits, waits, &op);
    if (err != CL_SUCCESS)
        return err;
    op->run = run_marker;
    return am_op_enqueue(op, event, blocking);
}

static cl_int CL_API_CALL am_clFlush(cl_command_queue queue) {
    /* every command is on its way already (the session's thread sends at once) */
    return am_is_queue(queue) ? CL_SUCCESS : CL_INVALID_COMMAND_QUEUE;
}

static cl_int CL_API_CALL am_clFinish(cl_command_queue queue) {
    return am_enqueue_marker(queue, CL_COMMAND_MARKER, 0, NULL, NULL, true);
}

static cl_int CL_API_CALL am_clEnqueueMarkerWithWaitList(cl_command_queue queue, cl_uint num, const cl_event *waits,
                                                         cl_event *event) {
    return am_enqueue_marker(queue, CL_COMMAND_MARKER, num, waits, event, false);
}

static cl_int CL_API_CALL am_clEnqueueBarrierWithWaitList(cl_command_queue queue, cl_uint num,
                                                          const cl_event *waits, cl_event *event) {
    return am_enqueue_marker(queue, CL_COMMAND_BARRIER, num, waits, event, false);
}

static cl_int CL_API_CALL am_clEnqueueMarker(cl_command_queue queue, cl_event *event) {
    if (event == NULL)
        return CL_INVALID_VALUE;
    return am_enqueue_marker(queue, CL_COMMAND_MARKER, 0, NULL, event, false);
}

static cl_int CL_API_CALL am_clEnqueueBarrier(cl_command_queue queue) {
    return am_enqueue_marker(queue, CL_COMMAND_BARRIER, 0, NULL, NULL, false);
}

static cl_int CL_API_CALL am_clEnqueueWaitForEvents(cl_command_queue queue, cl_uint num, const cl_event *events) {
    if (num == 0 || events == NULL)
        return CL_INVALID_VALUE;
    return am_enqueue_marker(queue, CL_COMMAND_BARRIER, num, events, NULL, false);
}

void am_queue_functions(cl_icd_dispatch *d);
void am_queue_functions(cl_icd_dispatch *d) {
    d->clCreateCommandQueue = am_clCreateCommandQueue;
    d->clCreateCommandQueueWithProperties = am_clCreateCommandQueueWithProperties;
    d->clRetainCommandQueue = am_clRetainCommandQueue;
    d->clReleaseCommandQueue = am_clReleaseCommandQueue;
    d->clGetCommandQueueInfo = am_clGetCommandQueueInfo;
    d->clSetCommandQueueProperty = am_clSetCommandQueueProperty;
    d->clFlush = am_clFlush;
    d->clFinish = am_clFinish;
    d->clEnqueueMarkerWithWaitList = am_clEnqueueMarkerWithWaitList;
    d->clEnqueueBarrierWithWaitList = am_clEnqueueBarrierWithWaitList;
    d->clEnqueueMarker = am_clEnqueueMarker;
    d->clEnqueueBarrier = am_clEnqueueBarrier;
    d->clEnqueueWaitForEvents = am_clEnqueueWaitForEvents;
}

/* Events: the status of each command as the session reports it (sent,
 * answered, completed on the device, or failed), user events, callbacks
 * (run on the context's notifier thread), waits and profiling times. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "icd.h"
#include "log.h"

bool am_is_event(cl_event event) {
    return event != NULL && event->magic == AM_MAGIC_EVENT;
}

cl_event am_event_new(cl_context ctx, cl_command_queue queue, cl_command_type type) {
    cl_event event = calloc(1, sizeof *event);
    if (event == NULL)
        return NULL;
    event->dispatch = &am_dispatch;
    event->magic = AM_MAGIC_EVENT;
    atomic_init(&event->refs, 1);
    event->context = ctx;
    am_ctx_retain(ctx);
    event->queue = queue;
    if (queue != NULL)
        am_queue_retain(queue);
    event->type = type;
    event->status = CL_QUEUED;
    event->profiled = queue != NULL && (queue->properties & CL_QUEUE_PROFILING_ENABLE) != 0;
    return event;
}

void am_event_retain(cl_event event) {
    atomic_fetch_add(&event->refs, 1);
}

void am_event_release(cl_event event) {
    if (atomic_fetch_sub(&event->refs, 1) != 1)
        return;
    for (am_event_callback *cb = event->callbacks, *next; cb != NULL; cb = next) {
        next = cb->next;
        free(cb);
    }
    cl_context ctx = event->context;
    cl_command_queue queue = event->queue;
    event->magic = AM_MAGIC_DEAD;
    free(event);
    if (queue != NULL)
        am_queue_release(queue);
    am_ctx_release(ctx);
}

typedef struct callback_notice {
    am_notice base;
    cl_event event;   /* retained */
    cl_int status;
    void(CL_CALLBACK *fn)(cl_event, cl_int, void *);
    void *data;
} callback_notice;

static void run_callback(am_notice *notice) {
    callback_notice *n = (callback_notice *)notice;
    n->fn(n->event, n->status, n->data);
    am_event_release(n->event);
    free(n);
}

static void post_callback_locked(cl_event event, cl_int status, void(CL_CALLBACK *fn)(cl_event, cl_int, void *),
                                 void *data) {
    callback_notice *n = calloc(1, sizeof *n);
    if (n == NULL) {
        am_error_log("out of memory: an event callback is lost");
        return;
    }
    n->base.run = run_callback;
    am_event_retain(event);
    n->event = event;
    n->status = status;
    n->fn = fn;
    n->data = data;
    am_ctx_post_locked(event->context, &n->base);
}

void am_event_set_status_locked(cl_event event, cl_int status) {
    if (event->status <= CL_COMPLETE)
        return; /* final */
    if (status >= 0 && status >= event->status)
        return; /* never back */
    event->status = status;
    cl_context ctx = event->context;
    if (status == CL_COMPLETE && event->profiled && !event->have_times) {
        /* no command of its own at the pool (a marker, a barrier): it
         * happened when the work before it ended */
        for (int i = 0; i < 4; i++)
            event->times[i] = ctx->last_end_ns;
        event->have_times = true;
    }
    am_event_callback **at = &event->callbacks;
    while (*at != NULL) {
        am_event_callback *cb = *at;
        if (status < 0 || status <= cb->on) {
            *at = cb->next;
            post_callback_locked(event, status < 0 ? status : cb->on, cb->fn, cb->data);
            free(cb);
        } else {
            at = &cb->next;
        }
    }
    pthread_cond_broadcast(&ctx->cond);
}

void am_event_set_status(cl_event event, cl_int status) {
    pthread_mutex_lock(&event->context->mu);
    am_event_set_status_locked(event, status);
    pthread_mutex_unlock(&event->context->mu);
}

cl_int am_check_wait_list(cl_context ctx, cl_uint num, const cl_event *waits) {
    if ((num == 0) != (waits == NULL))
        return CL_INVALID_EVENT_WAIT_LIST;
    for (cl_uint i = 0; i < num; i++)
        if (!am_is_event(waits[i]))
            return CL_INVALID_EVENT_WAIT_LIST;
        else if (waits[i]->context != ctx)
            return CL_INVALID_CONTEXT;
    return CL_SUCCESS;
}

cl_int am_events_wait(cl_uint num, const cl_event *events) {
    if (num == 0)
        return CL_SUCCESS;
    cl_context ctx = events[0]->context;
    uint64_t asked = 0;
    bool failed = false;
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        bool all_done = true;
        uint64_t need = 0;
        failed = false;
        for (cl_uint i = 0; i < num; i++) {
            if (events[i]->status > CL_COMPLETE) {
                all_done = false;
                if (events[i]->seq > need)
                    need = events[i]->seq;
            } else if (events[i]->status < 0) {
                failed = true;
            }
        }
        /* (done, while a completion hook is still ending: its broadcast comes) */
        if (all_done && ctx->completing == 0)
            break;
        if (need > asked) {
            pthread_mutex_unlock(&ctx->mu);
            am_session_ensure_completion(ctx->session, need);
            pthread_mutex_lock(&ctx->mu);
            asked = need;
            continue;
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += 1; /* (a look again now and then: nothing relies on it) */
        pthread_cond_timedwait(&ctx->cond, &ctx->mu, &until);
    }
    pthread_mutex_unlock(&ctx->mu);
    return failed ? CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST : CL_SUCCESS;
}

static cl_int CL_API_CALL am_clWaitForEvents(cl_uint num, const cl_event *events) {
    if (num == 0 || events == NULL)
        return CL_INVALID_VALUE;
    for (cl_uint i = 0; i < num; i++) {
        if (!am_is_event(events[i]))
            return CL_INVALID_EVENT;
        if (events[i]->context != events[0]->context)
            return CL_INVALID_CONTEXT;
    }
    return am_events_wait(num, events);
}

static cl_int CL_API_CALL am_clGetEventInfo(cl_event event, cl_event_info param, size_t size, void *value,
                                            size_t *size_ret) {
    if (!am_is_event(event))
        return CL_INVALID_EVENT;
    switch (param) {
    case CL_EVENT_COMMAND_QUEUE:
        return am_answer(size, value, size_ret, &event->queue, sizeof event->queue);
    case CL_EVENT_CONTEXT:
        return am_answer(size, value, size_ret, &event->context, sizeof event->context);
    case CL_EVENT_COMMAND_TYPE:
        return am_answer(size, value, size_ret, &event->type, sizeof event->type);
    case CL_EVENT_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&event->refs);
        return am_answer(size, value, size_ret, &refs, sizeof refs);
    }
    case CL_EVENT_COMMAND_EXECUTION_STATUS: {
        pthread_mutex_lock(&event->context->mu);
        cl_int status = event->status;
        uint64_t seq = event->seq;
        pthread_mutex_unlock(&event->context->mu);
        if (status > CL_COMPLETE && seq != 0) /* a loop polling it gets there */
            am_session_ensure_completion(event->context->session, seq);
        return am_answer(size, value, size_ret, &status, sizeof status);
    }
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_int CL_API_CALL am_clRetainEvent(cl_event event) {
    if (!am_is_event(event))
        return CL_INVALID_EVENT;
    am_event_retain(event);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseEvent(cl_event event) {
    if (!am_is_event(event))
        return CL_INVALID_EVENT;
    am_event_release(event);
    return CL_SUCCESS;
}

static cl_event CL_API_CALL am_clCreateUserEvent(cl_context ctx, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_event event = NULL;
    if (!am_is_context(ctx))
        err = CL_INVALID_CONTEXT;
    else if ((event = am_event_new(ctx, NULL, CL_COMMAND_USER)) == NULL)
        err = CL_OUT_OF_HOST_MEMORY;
    else {
        event->user = true;
        event->status = CL_SUBMITTED;
    }
    if (errcode != NULL)
        *errcode = err;
    return event;
}

static cl_int CL_API_CALL am_clSetUserEventStatus(cl_event event, cl_int status) {
    if (!am_is_event(event) || !event->user)
        return CL_INVALID_EVENT;
    if (status > CL_COMPLETE)
        return CL_INVALID_VALUE;
    cl_context ctx = event->context;
    pthread_mutex_lock(&ctx->mu);
    bool set_before = event->status <= CL_COMPLETE;
    if (!set_before)
        am_event_set_status_locked(event, status);
    pthread_mutex_unlock(&ctx->mu);
    if (set_before)
        return CL_INVALID_OPERATION;
    am_ctx_release_held(ctx); /* what waited for it goes now */
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clSetEventCallback(cl_event event, cl_int type,
                                                void(CL_CALLBACK *fn)(cl_event, cl_int, void *), void *data) {
    if (!am_is_event(event))
        return CL_INVALID_EVENT;
    if (fn == NULL || (type != CL_SUBMITTED && type != CL_RUNNING && type != CL_COMPLETE))
        return CL_INVALID_VALUE;
    cl_context ctx = event->context;
    pthread_mutex_lock(&ctx->mu);
    if (event->status < 0 || event->status <= type) {
        post_callback_locked(event, event->status < 0 ? event->status : type, fn, data);
    } else {
        am_event_callback *cb = malloc(sizeof *cb);
        if (cb == NULL) {
            pthread_mutex_unlock(&ctx->mu);
            return CL_OUT_OF_HOST_MEMORY;
        }
        cb->on = type;
        cb->fn = fn;
        cb->data = data;
        cb->next = event->callbacks;
        event->callbacks = cb;
    }
    uint64_t seq = event->status > CL_COMPLETE ? event->seq : 0;
    pthread_mutex_unlock(&ctx->mu);
    if (seq != 0) /* it comes without a wait: see that its completion is told */
        am_session_ensure_completion(ctx->session, seq);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clGetEventProfilingInfo(cl_event event, cl_profiling_info param, size_t size,
                                                     void *value, size_t *size_ret) {
    if (!am_is_event(event))
        return CL_INVALID_EVENT;
    int index;
    switch (param) {
    case CL_PROFILING_COMMAND_QUEUED: index = 0; break;
    case CL_PROFILING_COMMAND_SUBMIT: index = 1; break;
    case CL_PROFILING_COMMAND_START: index = 2; break;
    case CL_PROFILING_COMMAND_END:
    case CL_PROFILING_COMMAND_COMPLETE: index = 3; break;
    default:
        return CL_INVALID_VALUE;
    }
    cl_ulong time;
    pthread_mutex_lock(&event->context->mu);
    bool ready = event->profiled && !event->user && event->status == CL_COMPLETE && event->have_times;
    time = event->times[index];
    pthread_mutex_unlock(&event->context->mu);
    if (!ready)
        return CL_PROFILING_INFO_NOT_AVAILABLE;
    return am_answer(size, value, size_ret, &time, sizeof time);
}

void am_event_functions(cl_icd_dispatch *d);
void am_event_functions(cl_icd_dispatch *d) {
    d->clWaitForEvents = am_clWaitForEvents;
    d->clGetEventInfo = am_clGetEventInfo;
    d->clRetainEvent = am_clRetainEvent;
    d->clReleaseEvent = am_clReleaseEvent;
    d->clCreateUserEvent = am_clCreateUserEvent;
    d->clSetUserEventStatus = am_clSetUserEventStatus;
    d->clSetEventCallback = am_clSetEventCallback;
    d->clGetEventProfilingInfo = am_clGetEventProfilingInfo;
}

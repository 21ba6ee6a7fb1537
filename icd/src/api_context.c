/* Contexts: one session on the pool each (one device per context), the
 * completion of its events as the session reports it, and the notifier
 * thread that runs the application's callbacks. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "icd.h"
#include "log.h"

struct am_destructor {
    struct am_destructor *next;
    void(CL_CALLBACK *fn)(cl_context, void *);
    void *data;
};

struct am_watch {
    am_watch *next;
    cl_event event;   /* retained */
    uint64_t seq;
};

bool am_is_context(cl_context ctx) {
    return ctx != NULL && ctx->magic == AM_MAGIC_CONTEXT;
}

/* -- the notifier thread -------------------------------------------------------------- */

static void *notifier_main(void *arg) {
    cl_context ctx = arg;
    pthread_mutex_lock(&ctx->mu);
    for (;;) {
        while (ctx->notices == NULL && !ctx->notifier_stop)
            pthread_cond_wait(&ctx->notice_cond, &ctx->mu);
        am_notice *notice = ctx->notices;
        if (notice == NULL)
            break; /* stopping, nothing left */
        ctx->notices = notice->next;
        if (ctx->notices == NULL)
            ctx->notices_tail = NULL;
        pthread_mutex_unlock(&ctx->mu);
        notice->run(notice);
        pthread_mutex_lock(&ctx->mu);
    }
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

void am_ctx_post_locked(cl_context ctx, am_notice *notice) {
    notice->next = NULL;
    if (ctx->notices_tail != NULL)
        ctx->notices_tail->next = notice;
    else
        ctx->notices = notice;
    ctx->notices_tail = notice;
    if (!ctx->notifier_started && !ctx->notifier_stop) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        ctx->notifier_started = pthread_create(&ctx->notifier, NULL, notifier_main, ctx) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!ctx->notifier_started)
            am_error_log("cannot start a context's notifier thread: callbacks will not run");
    }
    pthread_cond_signal(&ctx->notice_cond);
}

void am_ctx_post(cl_context ctx, am_notice *notice) {
    pthread_mutex_lock(&ctx->mu);
    am_ctx_post_locked(ctx, notice);
    pthread_mutex_unlock(&ctx->mu);
}

typedef struct context_notice {
    am_notice base;
    cl_context ctx;
    char message[512];
} context_notice;

static void run_context_notice(am_notice *notice) {
    context_notice *n = (context_notice *)notice;
    n->ctx->notify(n->message, NULL, 0, n->ctx->notify_data);
    free(n);
}

void am_ctx_notify(cl_context ctx, const char *message) {
    am_warn("%s", message);
    if (ctx->notify == NULL)
        return;
    context_notice *n = calloc(1, sizeof *n);
    if (n == NULL)
        return;
    n->base.run = run_context_notice;
    n->ctx = ctx;
    snprintf(n->message, sizeof n->message, "accelmig-opencl: %s", message);
    am_ctx_post(ctx, &n->base);
}

/* -- completion, as the session tells it ---------------------------------------------- */

void am_ctx_watch_locked(cl_context ctx, cl_event event, uint64_t seq) {
    if (event->status <= CL_COMPLETE)
        return;
    am_error failure;
    if (am_session_failed(ctx->session, &failure)) {
        am_event_set_status_locked(event, am_error_to_cl(&failure, CL_OUT_OF_RESOURCES));
        return;
    }
    if (am_session_completed(ctx->session) >= seq) { /* (said before this watch was there) */
        am_event_set_status_locked(event, CL_COMPLETE);
        return;
    }
    am_watch *watch = malloc(sizeof *watch);
    if (watch == NULL) { /* no memory to wait with: complete it at the next finish the hard way */
        am_event_set_status_locked(event, CL_OUT_OF_HOST_MEMORY);
        return;
    }
    am_event_retain(event);
    watch->event = event;
    watch->seq = seq;
    /* by sequence (commands come in order: nearly always at the end) */
    am_watch **at = &ctx->watches;
    while (*at != NULL && (*at)->seq <= seq)
        at = &(*at)->next;
    watch->next = *at;
    *at = watch;
}

/* A reference for a hook of the session's I/O thread, unless the context
 * is ending already: its last reference went (on this thread, by an
 * earlier hook of the same batch), its destroy waits for this thread
 * before it frees anything, and a reference taken and dropped now would
 * end it a second time. */
static bool hook_retain(cl_context ctx) {
    int refs = atomic_load(&ctx->refs);
    while (refs > 0)
        if (atomic_compare_exchange_weak(&ctx->refs, &refs, refs + 1))
            return true;
    return false;
}

static void on_completed(void *arg, uint64_t upto) {
    cl_context ctx = arg;
    am_watch *done = NULL;
    /* Waiters see the completion only once the watches' references are
     * gone (`completing`): a waiter that then releases its last objects
     * ends the context on its own thread, not on this one. */
    if (!hook_retain(ctx))
        return; /* (ending: no event of it is left to complete) */
    pthread_mutex_lock(&ctx->mu);
    ctx->completing++;
    while (ctx->watches != NULL && ctx->watches->seq <= upto) {
        am_watch *watch = ctx->watches;
        ctx->watches = watch->next;
        am_event_set_status_locked(watch->event, CL_COMPLETE);
        watch->next = done;
        done = watch;
    }
    pthread_mutex_unlock(&ctx->mu);
    while (done != NULL) {
        am_watch *next = done->next;
        am_event_release(done->event);
        free(done);
        done = next;
    }
    pthread_mutex_lock(&ctx->mu);
    ctx->completing--;
    pthread_cond_broadcast(&ctx->cond);
    pthread_mutex_unlock(&ctx->mu);
    am_ctx_release(ctx);
}

/* fork(): the context's lock around it (its notifier may hold it); in the
 * child the notifier is gone, and what it had still to run was the
 * parent's to run (see session.h for the session's copy). */
static void on_fork(void *arg, enum am_fork_phase phase) {
    cl_context ctx = arg;
    if (phase == AM_FORK_PREPARE) {
        pthread_mutex_lock(&ctx->mu);
        return;
    }
    if (phase == AM_FORK_CHILD) {
        ctx->notifier_started = false;
        ctx->notices = ctx->notices_tail = NULL; /* (left: the parent runs them) */
    }
    pthread_mutex_unlock(&ctx->mu);
}

static void on_failed(void *arg, const am_error *err) {
    cl_context ctx = arg;
    am_watch *all;
    pthread_mutex_lock(&ctx->mu);
    all = ctx->watches;
    ctx->watches = NULL;
    for (am_watch *w = all; w != NULL; w = w->next)
        am_event_set_status_locked(w->event, am_error_to_cl(err, CL_OUT_OF_RESOURCES));
    pthread_mutex_unlock(&ctx->mu);
    while (all != NULL) {
        am_watch *next = all->next;
        am_event_release(all->event);
        free(all);
        all = next;
    }
    char message[600];
    snprintf(message, sizeof message, "the session on the pool ended: %s: %s", err->code, err->message);
    am_ctx_notify(ctx, message);
}

/* -- registries ------------------------------------------------------------------------- */

static int grow(void **array, size_t *cap, size_t count, size_t item) {
    if (count < *cap)
        return 0;
    size_t more = *cap ? *cap * 2 : 8;
    void *bigger = realloc(*array, more * item);
    if (bigger == NULL)
        return -1;
    *array = bigger;
    *cap = more;
    return 0;
}

void am_ctx_add_mem(cl_context ctx, cl_mem mem) {
    pthread_mutex_lock(&ctx->mu);
    if (grow((void **)&ctx->mems, &ctx->cap_mems, ctx->num_mems, sizeof *ctx->mems) == 0)
        ctx->mems[ctx->num_mems++] = mem;
    pthread_mutex_unlock(&ctx->mu);
}

void am_ctx_remove_mem(cl_context ctx, cl_mem mem) {
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 0; i < ctx->num_mems; i++)
        if (ctx->mems[i] == mem) {
            ctx->mems[i] = ctx->mems[--ctx->num_mems];
            break;
        }
    pthread_mutex_unlock(&ctx->mu);
}

bool am_ctx_has_mem(cl_context ctx, const void *maybe) {
    bool found = false;
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 0; i < ctx->num_mems && !found; i++)
        found = (const void *)ctx->mems[i] == maybe;
    pthread_mutex_unlock(&ctx->mu);
    return found;
}

void am_ctx_add_queue(cl_context ctx, cl_command_queue queue) {
    pthread_mutex_lock(&ctx->mu);
    if (grow((void **)&ctx->queues, &ctx->cap_queues, ctx->num_queues, sizeof *ctx->queues) == 0)
        ctx->queues[ctx->num_queues++] = queue;
    pthread_mutex_unlock(&ctx->mu);
}

void am_ctx_remove_queue(cl_context ctx, cl_command_queue queue) {
    pthread_mutex_lock(&ctx->mu);
    for (size_t i = 0; i < ctx->num_queues; i++)
        if (ctx->queues[i] == queue) {
            ctx->queues[i] = ctx->queues[--ctx->num_queues];
            break;
        }
    pthread_mutex_unlock(&ctx->mu);
}

/* -- life ----------------------------------------------------------------------------------- */

void am_ctx_retain(cl_context ctx) {
    atomic_fetch_add(&ctx->refs, 1);
}

static void destroy(cl_context ctx) {
    bool released = atomic_load(&ctx->app_refs) == 0;
    am_session_close(ctx->session); /* (no hook runs after it) */
    ctx->session = NULL;
    pthread_mutex_lock(&ctx->mu);
    ctx->notifier_stop = true;
    pthread_cond_signal(&ctx->notice_cond);
    bool started = ctx->notifier_started;
    pthread_mutex_unlock(&ctx->mu);
    if (started)
        pthread_join(ctx->notifier, NULL); /* (it runs what was posted first) */
    for (struct am_destructor *d = ctx->destructors, *next; d != NULL; d = next) {
        next = d->next;
        d->fn(ctx, d->data);
        free(d);
    }
    ctx->magic = AM_MAGIC_DEAD;
    free(ctx->props);
    free(ctx->mems);
    free(ctx->queues);
    pthread_cond_destroy(&ctx->notice_cond);
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->mu);
    free(ctx);
    if (released)
        am_platform_dying_end();
}

static void *reaper_main(void *arg) {
    destroy(arg);
    return NULL;
}

void am_ctx_release(cl_context ctx) {
    if (atomic_fetch_sub(&ctx->refs, 1) != 1)
        return;
    /* The last reference may go on one of the context's own threads (an
     * event released by a hook or a callback): that thread cannot join
     * itself, so another one does the work. */
    bool own_thread = ctx->notifier_started && pthread_equal(pthread_self(), ctx->notifier);
    own_thread = own_thread || am_session_on_io_thread(ctx->session);
    if (!own_thread) {
        destroy(ctx);
        return;
    }
    pthread_t reaper;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&reaper, &attr, reaper_main, ctx) != 0)
        am_error_log("cannot start a thread to end a context: its session stays until the process ends");
    pthread_attr_destroy(&attr);
}

static cl_int check_properties(const cl_context_properties *props, size_t *len, bool *user_sync) {
    *len = 0;
    *user_sync = false;
    if (props == NULL)
        return CL_SUCCESS;
    bool seen_platform = false, seen_sync = false;
    size_t i = 0;
    for (; props[i] != 0; i += 2) {
        if (i > 64)
            return CL_INVALID_PROPERTY;
        switch (props[i]) {
        case CL_CONTEXT_PLATFORM:
            if (seen_platform)
                return CL_INVALID_PROPERTY;
            seen_platform = true;
            if ((cl_platform_id)props[i + 1] != &am_platform_get()->handle)
                return CL_INVALID_PLATFORM;
            break;
        case CL_CONTEXT_INTEROP_USER_SYNC:
            if (seen_sync)
                return CL_INVALID_PROPERTY;
            seen_sync = true;
            *user_sync = props[i + 1] != 0;
            break;
        default:
            return CL_INVALID_PROPERTY;
        }
    }
    *len = i + 1;
    return CL_SUCCESS;
}

static cl_context CL_API_CALL am_clCreateContext(const cl_context_properties *props, cl_uint num_devices,
                                                 const cl_device_id *devices,
                                                 void(CL_CALLBACK *notify)(const char *, const void *, size_t,
                                                                           void *),
                                                 void *user_data, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    size_t props_len;
    bool user_sync;
    cl_context ctx = NULL;
    if (devices == NULL || num_devices == 0 || (notify == NULL && user_data != NULL)) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    if ((err = check_properties(props, &props_len, &user_sync)) != CL_SUCCESS)
        goto out;
    for (cl_uint i = 0; i < num_devices; i++)
        if (!am_is_device(devices[i])) {
            err = CL_INVALID_DEVICE;
            goto out;
        }
    for (cl_uint i = 1; i < num_devices; i++)
        if (devices[i] != devices[0]) {
            /* each device is a session of its own at the pool, and buffers
             * would have to live in all of them: one device per context */
            am_warn("clCreateContext: a context of several devices is not supported by this driver (yet): "
                    "make one context per device");
            err = CL_OUT_OF_RESOURCES;
            goto out;
        }
    am_error why = {0};
    const am_config *cfg = am_platform_config(&why);
    if (cfg == NULL) {
        err = CL_DEVICE_NOT_AVAILABLE;
        goto out;
    }
    ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto out;
    }
    ctx->dispatch = &am_dispatch;
    atomic_init(&ctx->refs, 1);
    atomic_init(&ctx->app_refs, 1);
    ctx->device = devices[0];
    ctx->notify = notify;
    ctx->notify_data = user_data;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&ctx->cond, &attr);
    pthread_condattr_destroy(&attr);
    pthread_cond_init(&ctx->notice_cond, NULL);
    if (props_len) {
        ctx->props = malloc(props_len * sizeof *ctx->props);
        if (ctx->props == NULL) {
            err = CL_OUT_OF_HOST_MEMORY;
            goto fail;
        }
        memcpy(ctx->props, props, props_len * sizeof *ctx->props);
        ctx->props_len = props_len;
    }
    am_session_hooks hooks = {.ctx = ctx, .completed = on_completed, .failed = on_failed, .fork = on_fork};
    ctx->session = am_session_open(cfg, am_platform_tls(), ctx->device->id, &hooks, &why);
    if (ctx->session == NULL) {
        am_warn("clCreateContext: no session on the pool at %s: %s: %s", cfg->endpoint, why.code, why.message);
        err = strcmp(why.code, "QUOTA_EXCEEDED") == 0 ? CL_OUT_OF_RESOURCES : CL_DEVICE_NOT_AVAILABLE;
        goto fail;
    }
    ctx->magic = AM_MAGIC_CONTEXT;
    am_platform_context_made();
    goto out;
fail:
    pthread_cond_destroy(&ctx->notice_cond);
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->mu);
    free(ctx->props);
    free(ctx);
    ctx = NULL;
out:
    if (errcode != NULL)
        *errcode = err;
    return err == CL_SUCCESS ? ctx : NULL;
}

static cl_context CL_API_CALL am_clCreateContextFromType(const cl_context_properties *props, cl_device_type type,
                                                         void(CL_CALLBACK *notify)(const char *, const void *,
                                                                                   size_t, void *),
                                                         void *user_data, cl_int *errcode) {
    cl_device_id device;
    cl_uint found = 0;
    cl_int err = am_dispatch.clGetDeviceIDs(NULL, type, 1, &device, &found);
    if (err != CL_SUCCESS) {
        if (errcode != NULL)
            *errcode = err;
        return NULL;
    }
    return am_clCreateContext(props, 1, &device, notify, user_data, errcode);
}

static cl_int CL_API_CALL am_clRetainContext(cl_context ctx) {
    if (!am_is_context(ctx))
        return CL_INVALID_CONTEXT;
    atomic_fetch_add(&ctx->app_refs, 1);
    am_ctx_retain(ctx);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseContext(cl_context ctx) {
    if (!am_is_context(ctx))
        return CL_INVALID_CONTEXT;
    if (atomic_fetch_sub(&ctx->app_refs, 1) == 1)
        am_platform_dying_begin(); /* (until destroy: the exit waits for it) */
    am_ctx_release(ctx);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clGetContextInfo(cl_context ctx, cl_context_info param, size_t size, void *value,
                                              size_t *size_ret) {
    if (!am_is_context(ctx))
        return CL_INVALID_CONTEXT;
    switch (param) {
    case CL_CONTEXT_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&ctx->refs);
        return am_answer(size, value, size_ret, &refs, sizeof refs);
    }
    case CL_CONTEXT_NUM_DEVICES: {
        cl_uint one = 1;
        return am_answer(size, value, size_ret, &one, sizeof one);
    }
    case CL_CONTEXT_DEVICES:
        return am_answer(size, value, size_ret, &ctx->device, sizeof ctx->device);
    case CL_CONTEXT_PROPERTIES:
        return am_answer(size, value, size_ret, ctx->props, ctx->props_len * sizeof *ctx->props);
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_int CL_API_CALL am_clSetContextDestructorCallback(cl_context ctx,
                                                             void(CL_CALLBACK *fn)(cl_context, void *),
                                                             void *data) {
    if (!am_is_context(ctx))
        return CL_INVALID_CONTEXT;
    if (fn == NULL)
        return CL_INVALID_VALUE;
    struct am_destructor *d = malloc(sizeof *d);
    if (d == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    d->fn = fn;
    d->data = data;
    pthread_mutex_lock(&ctx->mu);
    d->next = ctx->destructors; /* called in the reverse order of their registration */
    ctx->destructors = d;
    pthread_mutex_unlock(&ctx->mu);
    return CL_SUCCESS;
}

cl_int am_call(cl_context ctx, am_cmd *cmd, cl_int fallback, am_cmd **out) {
    cmd->waited = true;
    am_error err;
    if (am_session_submit(ctx->session, cmd, NULL, &err) != 0) {
        am_cmd_free(cmd);
        return am_error_to_cl(&err, CL_OUT_OF_RESOURCES);
    }
    am_session_wait(ctx->session, cmd);
    cl_int rc = cmd->ok ? CL_SUCCESS : am_error_to_cl(&cmd->error, fallback);
    if (!cmd->ok)
        am_info("%s failed: %s: %s", cmd->op, cmd->error.code, cmd->error.message);
    if (out != NULL)
        *out = cmd;
    else
        am_cmd_free(cmd);
    return rc;
}

void am_context_functions(cl_icd_dispatch *d);
void am_context_functions(cl_icd_dispatch *d) {
    d->clCreateContext = am_clCreateContext;
    d->clCreateContextFromType = am_clCreateContextFromType;
    d->clRetainContext = am_clRetainContext;
    d->clReleaseContext = am_clReleaseContext;
    d->clGetContextInfo = am_clGetContextInfo;
    d->clSetContextDestructorCallback = am_clSetContextDestructorCallback;
}

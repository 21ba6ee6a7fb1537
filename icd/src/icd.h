/* The OpenCL objects of the accelmig driver and what the API files share.
 *
 * Every object starts with the ICD dispatch table (the Khronos loader
 * calls through it: cl_icd.h), then a magic number that tells its kind
 * (an object passed where another kind belongs is refused the OpenCL way,
 * not followed).
 *
 * Ownership (one owner per allocation):
 *   - the platform and its devices: the process's, made once, never freed
 *     (the ICD contract: the loader keeps the platform id);
 *   - a context owns its session (one device per context), its notifier
 *     thread and its lists; queues, buffers, programs and events retain it;
 *   - a buffer owns its mirror (the host copy maps use) unless it is the
 *     application's (CL_MEM_USE_HOST_PTR); a sub-buffer retains its parent;
 *   - a program owns its source or binary, its build's log and names;
 *     kernels retain their program;
 *   - an event retains its context and queue; a command's hook and the
 *     context's completion watch each hold a reference while they need it;
 *   - an enqueued operation (am_op) owns its copies and the references it
 *     took, until it ran (or failed) and was freed.
 *
 * Locking: each context's `mu` guards its events' status, its watches,
 * its queues' held operations and its registries; `cond` is signalled on
 * every status change.  A queue's `submit_mu` keeps its commands in order
 * from the check for held work to the session (taken before ctx->mu).
 * A kernel's `mu` guards its arguments, a buffer's its mappings, a
 * program's its build state.  The session's lock is below all of them;
 * hooks from the session's I/O thread run with none of its locks held.
 * Callbacks of the application (event, build and context notifications)
 * run on the context's notifier thread, never under a lock of ours. */
#ifndef ACCELMIG_ICD_H
#define ACCELMIG_ICD_H

#include <CL/cl.h>
#include <CL/cl_ext.h>
#include <CL/cl_icd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "buffer.h"
#include "config.h"
#include "devparams.h"
#include "errors.h"
#include "link.h"
#include "rect.h"
#include "session.h"

#define AM_MAGIC_PLATFORM 0x616d5046u
#define AM_MAGIC_DEVICE 0x616d4456u
#define AM_MAGIC_CONTEXT 0x616d4358u
#define AM_MAGIC_QUEUE 0x616d5155u
#define AM_MAGIC_MEM 0x616d4d45u
#define AM_MAGIC_PROGRAM 0x616d5052u
#define AM_MAGIC_KERNEL 0x616d4b4eu
#define AM_MAGIC_EVENT 0x616d4556u
#define AM_MAGIC_DEAD 0x64656164u

#define AM_PLATFORM_NAME "accelmig"
#define AM_PLATFORM_VENDOR "accelmig"
#define AM_PLATFORM_VERSION "OpenCL 3.0 accelmig " ACCELMIG_ICD_VERSION
#define AM_ICD_SUFFIX "ACCELMIG"
/* a blocking write of this size or more is sent from the caller's memory
 * and waits for its reply; smaller ones are copied and return at once */
#define AM_ZERO_COPY_WRITE (1u << 20)
#define AM_MAX_DEVICES 64

extern cl_icd_dispatch am_dispatch;

struct _cl_platform_id {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
};

struct _cl_device_id {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    char id[64];                 /* the pool's device id (open's device) */
    cl_device_type type;
    am_devparams params;
};

/* The process's one platform (the ICD contract): its configuration and
 * devices, found once (the first clGetDeviceIDs that reaches the pool). */
typedef struct am_platform {
    struct _cl_platform_id handle;
    pthread_mutex_t mu;
    bool configured;
    am_config config;
    am_error config_error;
    bool config_ok;
    SSL_CTX *tls;                /* NULL: insecure, said by the configuration */
    bool discovered;
    bool discovery_failed;       /* said once as a warning; again at info level */
    struct _cl_device_id devices[AM_MAX_DEVICES];
    cl_uint num_devices;
    /* contexts the application released whose last internal reference has
     * not gone yet (an event a hook or a callback still holds): the
     * process's exit waits for them a while, so that their sessions are
     * released at the pool, not left to its grace */
    int dying;
    pthread_cond_t dying_done;
    bool exit_hook;
} am_platform;

am_platform *am_platform_get(void);
/* A context was made (the exit hook is set then, before anything can be dying). */
void am_platform_context_made(void);
/* The application released a context for the last time (begin); it is gone (end). */
void am_platform_dying_begin(void);
void am_platform_dying_end(void);
/* The configuration (loaded once); NULL and why when it is wrong. */
const am_config *am_platform_config(am_error *err);
SSL_CTX *am_platform_tls(void);
bool am_is_device(cl_device_id device);

/* a notification for the application, run on the context's notifier thread */
typedef struct am_notice am_notice;
struct am_notice {
    am_notice *next;
    void (*run)(am_notice *notice);   /* runs it and frees it */
};

typedef struct am_watch am_watch;
typedef struct am_op am_op;

struct _cl_context {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;                 /* the application's and its objects' */
    atomic_int app_refs;             /* the application's own (clCreateContext, clRetainContext) */
    cl_device_id device;
    cl_context_properties *props;    /* owned copy, 0-terminated (NULL: none given) */
    size_t props_len;
    void(CL_CALLBACK *notify)(const char *, const void *, size_t, void *);
    void *notify_data;
    am_session *session;             /* owned */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    am_watch *watches;               /* events waiting for their command's completion, by seq */
    int completing;                  /* completion hooks under way: waiters wait for them to end */
    cl_command_queue *queues;        /* weak: removed when a queue goes */
    size_t num_queues, cap_queues;
    cl_mem *mems;                    /* weak: live buffers (clSetKernelArg without argument info) */
    size_t num_mems, cap_mems;
    uint64_t last_end_ns;            /* the latest profiled command's end (markers' times) */
    /* the notifier thread (started with the first notice) */
    pthread_t notifier;
    bool notifier_started, notifier_stop;
    am_notice *notices, *notices_tail;
    pthread_cond_t notice_cond;
    struct am_destructor *destructors; /* clSetContextDestructorCallback, LIFO */
};

struct _cl_command_queue {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;
    cl_context context;              /* retained */
    cl_device_id device;
    cl_command_queue_properties properties;
    cl_queue_properties props_array[8];
    size_t props_array_len;          /* 0: created without a properties array */
    pthread_mutex_t submit_mu;
    am_op *held, *held_tail;         /* waiting for events (ctx->mu) */
};

typedef struct am_mapping {
    struct am_mapping *next;
    void *ptr;
    size_t offset, size;
    cl_map_flags flags;
} am_mapping;

struct am_mem_destructor {
    struct am_mem_destructor *next;
    void(CL_CALLBACK *fn)(cl_mem, void *);
    void *data;
};

struct _cl_mem {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;
    cl_context context;              /* retained */
    cl_mem_flags flags;
    size_t size;
    void *host_ptr;                  /* CL_MEM_USE_HOST_PTR: the application's */
    uint64_t handle;
    cl_mem parent;                   /* a sub-buffer's (retained) */
    size_t origin;                   /* a sub-buffer's offset in its parent */
    cl_mem_properties *props;        /* owned (clCreateBufferWithProperties), 0-terminated */
    size_t props_len;
    pthread_mutex_t mu;
    uint8_t *mirror;                 /* owned host copy for maps (root buffers without a host pointer) */
    am_mapping *mappings;
    cl_uint map_count;
    atomic_int alloc_error;          /* the pool refused the allocation (its CL code; 0: none known) */
    struct am_mem_destructor *destructors;
};

struct _cl_program {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;
    cl_context context;              /* retained */
    char *source;                    /* owned (from source) */
    size_t source_len;
    uint8_t *binary;                 /* owned (from a binary) */
    size_t binary_len;
    pthread_mutex_t mu;
    cl_build_status status;
    char *options;                   /* owned: the application's options of the last build */
    char *log;                       /* owned */
    uint64_t handle;                 /* the built program at the pool (0: none) */
    char **kernel_names;             /* owned */
    size_t num_kernels;
    size_t binary_size;
    /* clCompileProgram's unit (its includes resolved, its -D options apart:
     * a compiled object or a library), which clLinkProgram builds from */
    char *unit;                      /* owned */
    size_t unit_len;
    char *unit_options;              /* owned: the compile's options, less the -I the driver read */
    cl_program_binary_type binary_type;
    bool linked;                     /* made by clLinkProgram: no source of its own to build again */
    bool arg_info;                   /* built with -cl-kernel-arg-info (arguments' names and types) */
    atomic_int kernels;              /* kernels made from it, alive */
};

typedef enum { AM_ARG_UNSET, AM_ARG_BUFFER, AM_ARG_NULL, AM_ARG_LOCAL, AM_ARG_RAW } am_arg_kind;

typedef struct am_arg {
    am_arg_kind kind;
    cl_mem mem;                      /* AM_ARG_BUFFER (not retained, as in OpenCL) */
    size_t size;                     /* AM_ARG_LOCAL: bytes; AM_ARG_RAW: the value's */
    uint8_t raw[64];                 /* small values here, larger ones in `big` */
    uint8_t *big;                    /* owned */
} am_arg;

typedef struct am_arg_info {
    cl_kernel_arg_address_qualifier address;
    cl_kernel_arg_access_qualifier access;
    cl_kernel_arg_type_qualifier type_qualifier;
    char *type_name;                 /* owned */
    char *name;                      /* owned */
} am_arg_info;

struct _cl_kernel {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;
    cl_program program;              /* retained */
    char *name;                      /* owned */
    cl_uint num_args;
    am_arg_info *arg_info;           /* owned; NULL: the runtime has none (a binary) */
    char *attributes;                /* owned */
    size_t wg_size, compile_size[3], preferred_multiple;
    cl_ulong local_mem, private_mem;
    pthread_mutex_t mu;
    am_arg *args;                    /* owned, num_args of them */
};

typedef struct am_event_callback {
    struct am_event_callback *next;
    cl_int on;                       /* CL_SUBMITTED, CL_RUNNING or CL_COMPLETE */
    void(CL_CALLBACK *fn)(cl_event, cl_int, void *);
    void *data;
} am_event_callback;

struct _cl_event {
    const cl_icd_dispatch *dispatch;
    uint32_t magic;
    atomic_int refs;
    cl_context context;              /* retained */
    cl_command_queue queue;          /* retained; NULL for a user event */
    cl_command_type type;
    cl_int status;                   /* ctx->mu */
    uint64_t seq;                    /* the command's last sequence number (0: not sent yet) */
    bool user;
    bool profiled;
    bool have_times;
    cl_ulong times[4];               /* queued, submit, start, end (the pool's clock) */
    am_event_callback *callbacks;    /* ctx->mu */
};

/* -- an enqueued operation ---------------------------------------------------------- */
struct am_op {
    am_op *next;
    cl_command_queue queue;          /* (the queue holds it while it is held) */
    cl_event event;                  /* retained: the operation's own */
    cl_event *waits;                 /* retained, owned array */
    cl_uint num_waits;
    /* send its commands; CL_SUCCESS or the error its event then carries */
    cl_int (*run)(am_op *op);
    void (*release)(am_op *op);      /* what it holds, but the op itself */
};

/* Allocate an operation of `size` bytes (a struct whose first member is
 * an am_op) for `queue`, with its event and wait list (retained);
 * CL_SUCCESS or the OpenCL error (invalid wait list, no memory). */
cl_int am_op_new(cl_command_queue queue, size_t size, cl_command_type type, cl_uint num_waits,
                 const cl_event *waits, am_op **out);
/* Run it now, or hold it in its queue until its wait list allows; then
 * hand the event to the application (`event` non-NULL) and, with
 * `blocking`, wait for it.  Takes the operation whatever happens. */
cl_int am_op_enqueue(am_op *op, cl_event *event, bool blocking);
void am_op_free(am_op *op);
/* A marker (or barrier, a map without transfer...): its event completes
 * with every command sent before it. */
cl_int am_enqueue_marker(cl_command_queue queue, cl_command_type type, cl_uint num_waits, const cl_event *waits,
                         cl_event *event, bool blocking);
/* Held operations of `ctx`'s queues whose wait lists allow now: run them. */
void am_ctx_release_held(cl_context ctx);

/* -- commands of an operation --------------------------------------------------------- */
/* A command for `op` (its hook updates the op's event): op and fields (the
 * JSON fields, no braces), payload borrowed or `owned`; `completes`: its
 * reply means completion. NULL when out of memory. */
am_cmd *am_op_cmd(am_op *op, const char *wire_op, const char *fields, const void *payload, uint64_t len,
                  bool owned, bool completes);
/* Submit a command of an op (the last one of the op when `last`: it sets
 * the event's seq and its completion watch). */
cl_int am_op_submit(am_op *op, am_cmd *cmd, bool last);
/* The command needs more than its event until it is answered: `mem`
 * alive (its payload or its destination is the buffer's mirror; retained
 * here), and, with `packed`, a rect read unpacked into `host` at `base`
 * (`packed` owned from now on). NULL-safe: false when out of memory. */
bool am_op_cmd_keep(am_cmd *cmd, cl_mem mem, const am_rect *host, uint8_t *base, uint8_t *packed);

/* -- events ------------------------------------------------------------------------- */
cl_event am_event_new(cl_context ctx, cl_command_queue queue, cl_command_type type);
void am_event_retain(cl_event event);
void am_event_release(cl_event event);
/* Move the status on (never back; a negative status is final): callbacks
 * due are posted, waiters woken.  Takes ctx->mu. */
void am_event_set_status(cl_event event, cl_int status);
void am_event_set_status_locked(cl_event event, cl_int status);
/* Complete `event` when its session completes command `seq` (ctx->mu held). */
void am_ctx_watch_locked(cl_context ctx, cl_event event, uint64_t seq);
/* Block until every event is complete (or failed): CL_SUCCESS, or
 * CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST when one failed. */
cl_int am_events_wait(cl_uint num, const cl_event *events);
bool am_is_event(cl_event event);
/* CL_SUCCESS when `waits` is a valid wait list of `ctx` */
cl_int am_check_wait_list(cl_context ctx, cl_uint num, const cl_event *waits);

/* -- the rest --------------------------------------------------------------------------- */
void am_ctx_retain(cl_context ctx);
void am_ctx_release(cl_context ctx);
bool am_is_context(cl_context ctx);
void am_ctx_post(cl_context ctx, am_notice *notice);
void am_ctx_post_locked(cl_context ctx, am_notice *notice);
/* Tell the application (pfn_notify of clCreateContext) something went wrong. */
void am_ctx_notify(cl_context ctx, const char *message);
void am_ctx_add_mem(cl_context ctx, cl_mem mem);
void am_ctx_remove_mem(cl_context ctx, cl_mem mem);
bool am_ctx_has_mem(cl_context ctx, const void *maybe);
void am_ctx_add_queue(cl_context ctx, cl_command_queue queue);
void am_ctx_remove_queue(cl_context ctx, cl_command_queue queue);

bool am_is_queue(cl_command_queue queue);
bool am_is_mem(cl_mem mem);
bool am_is_program(cl_program program);
bool am_is_kernel(cl_kernel kernel);
void am_mem_retain(cl_mem mem);
void am_mem_release(cl_mem mem);
void am_program_retain(cl_program program);
void am_program_release(cl_program program);
void am_kernel_retain(cl_kernel kernel);
void am_kernel_release(cl_kernel kernel);
void am_queue_retain(cl_command_queue queue);
void am_queue_release(cl_command_queue queue);
/* The buffer at the root of a sub-buffer chain (itself for a buffer). */
cl_mem am_mem_root(cl_mem mem);
/* The device's value of a parameter as an integer (0 when absent). */
uint64_t am_device_uint(cl_device_id device, cl_device_info param);

/* A value of an info query: the OpenCL contract of every clGet*Info. */
cl_int am_answer(size_t size, void *value, size_t *size_ret, const void *data, size_t len);
cl_int am_answer_str(size_t size, void *value, size_t *size_ret, const char *text);
/* Submit a command and wait for its reply: CL_SUCCESS or the reply's error
 * (`fallback` when no OpenCL code fits); `out` keeps the command (the
 * caller frees it) when non-NULL. */
cl_int am_call(cl_context ctx, am_cmd *cmd, cl_int fallback, am_cmd **out);

#endif

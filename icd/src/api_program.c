/* Programs and kernels.  A program is built at the pool (build from its
 * source, build_binary from a device binary), its build log and kernel
 * names kept here; a source's #include directives are resolved here, on
 * the application's side (includes.h).  Separate compilation: the pool
 * compiles whole programs, so clCompileProgram keeps the unit (its headers
 * put in) and clLinkProgram builds the units together as one program,
 * each with its own -D macros (so a compile error is told at the link, in
 * its log; units that define the same static name clash there); every build asks the runtime for argument information
 * (-cl-kernel-arg-info), which tells this driver how each argument of
 * clSetKernelArg travels (a buffer, local memory, a value) — the
 * application sees it only if it asked for it, as from its runtime.  A
 * kernel is created with one kernel_info round trip (its arguments, its
 * work-group limits), then set and launched locally. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "icd.h"
#include "includes.h"
#include "json.h"
#include "log.h"

#define ARG_INFO_OPTION "-cl-kernel-arg-info"
#define MAX_KERNEL_ARGS 4096
#define MAX_RAW_ARG 4096

bool am_is_program(cl_program program) {
    return program != NULL && program->magic == AM_MAGIC_PROGRAM;
}

bool am_is_kernel(cl_kernel kernel) {
    return kernel != NULL && kernel->magic == AM_MAGIC_KERNEL;
}

void am_program_retain(cl_program program) {
    atomic_fetch_add(&program->refs, 1);
}

static void free_program_at_pool(cl_context ctx, uint64_t handle) {
    char fields[48];
    snprintf(fields, sizeof fields, "\"prog\":%" PRIu64, handle);
    am_cmd *cmd = am_cmd_new("free_program", fields, NULL, 0, false);
    am_error err;
    if (cmd != NULL && am_session_submit(ctx->session, cmd, NULL, &err) != 0)
        am_cmd_free(cmd);
}

static void free_names(cl_program program) {
    for (size_t i = 0; i < program->num_kernels; i++)
        free(program->kernel_names[i]);
    free(program->kernel_names);
    program->kernel_names = NULL;
    program->num_kernels = 0;
}

void am_program_release(cl_program program) {
    if (atomic_fetch_sub(&program->refs, 1) != 1)
        return;
    cl_context ctx = program->context;
    if (program->handle != 0)
        free_program_at_pool(ctx, program->handle);
    free_names(program);
    free(program->source);
    free(program->binary);
    free(program->options);
    free(program->log);
    free(program->unit);
    free(program->unit_options);
    program->magic = AM_MAGIC_DEAD;
    pthread_mutex_destroy(&program->mu);
    free(program);
    am_ctx_release(ctx);
}

static cl_program make_program(cl_context ctx) {
    cl_program program = calloc(1, sizeof *program);
    if (program == NULL)
        return NULL;
    program->dispatch = &am_dispatch;
    atomic_init(&program->refs, 1);
    atomic_init(&program->kernels, 0);
    program->context = ctx;
    program->status = CL_BUILD_NONE;
    pthread_mutex_init(&program->mu, NULL);
    am_ctx_retain(ctx);
    program->magic = AM_MAGIC_PROGRAM;
    return program;
}

static cl_program CL_API_CALL am_clCreateProgramWithSource(cl_context ctx, cl_uint count, const char **strings,
                                                           const size_t *lengths, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_program program = NULL;
    am_buf source;
    am_buf_init(&source);
    if (!am_is_context(ctx)) {
        err = CL_INVALID_CONTEXT;
        goto out;
    }
    if (count == 0 || strings == NULL) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    for (cl_uint i = 0; i < count; i++) {
        if (strings[i] == NULL) {
            err = CL_INVALID_VALUE;
            goto out;
        }
        size_t len = lengths != NULL && lengths[i] != 0 ? lengths[i] : strlen(strings[i]);
        if (am_buf_append(&source, strings[i], len) != 0) {
            err = CL_OUT_OF_HOST_MEMORY;
            goto out;
        }
    }
    if ((program = make_program(ctx)) == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto out;
    }
    program->source_len = source.len;
    program->source = am_buf_take(&source);
out:
    am_buf_free(&source);
    if (errcode != NULL)
        *errcode = err;
    return program;
}

static cl_program CL_API_CALL am_clCreateProgramWithBinary(cl_context ctx, cl_uint num_devices,
                                                           const cl_device_id *devices, const size_t *lengths,
                                                           const unsigned char **binaries, cl_int *status,
                                                           cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_program program = NULL;
    if (!am_is_context(ctx))
        err = CL_INVALID_CONTEXT;
    else if (num_devices == 0 || devices == NULL)
        err = CL_INVALID_VALUE;
    else if (num_devices != 1 || devices[0] != ctx->device)
        err = CL_INVALID_DEVICE;
    else if (lengths == NULL || binaries == NULL || lengths[0] == 0 || binaries[0] == NULL)
        err = CL_INVALID_VALUE;
    else if ((program = make_program(ctx)) == NULL || (program->binary = malloc(lengths[0])) == NULL)
        err = CL_OUT_OF_HOST_MEMORY;
    if (err == CL_SUCCESS) {
        memcpy(program->binary, binaries[0], lengths[0]);
        program->binary_len = lengths[0];
        if (status != NULL)
            status[0] = CL_SUCCESS; /* (the device's runtime judges it at the build) */
    } else if (program != NULL) {
        am_program_release(program);
        program = NULL;
    }
    if (errcode != NULL)
        *errcode = err;
    return program;
}

static cl_program CL_API_CALL am_clCreateProgramWithBuiltInKernels(cl_context ctx, cl_uint num_devices,
                                                                   const cl_device_id *devices, const char *names,
                                                                   cl_int *errcode) {
    (void)num_devices, (void)devices, (void)names;
    if (errcode != NULL)
        *errcode = am_is_context(ctx) ? CL_INVALID_VALUE : CL_INVALID_CONTEXT; /* the devices list none */
    return NULL;
}

static cl_program CL_API_CALL am_clCreateProgramWithIL(cl_context ctx, const void *il, size_t length,
                                                       cl_int *errcode) {
    (void)il, (void)length;
    if (errcode != NULL)
        *errcode = am_is_context(ctx) ? CL_INVALID_OPERATION : CL_INVALID_CONTEXT; /* no IL (CL_DEVICE_IL_VERSION "") */
    return NULL;
}

/* The build's kernel names from its reply (bounded and checked). */
static int take_names(cl_program program, json_object *reply) {
    json_object *kernels = am_json_get(reply, "kernels");
    if (kernels == NULL || !json_object_is_type(kernels, json_type_array) ||
        json_object_array_length(kernels) > 65536)
        return -1;
    size_t n = json_object_array_length(kernels);
    char **names = calloc(n ? n : 1, sizeof *names);
    if (names == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        json_object *name = json_object_array_get_idx(kernels, i);
        size_t len = json_object_is_type(name, json_type_string) ? (size_t)json_object_get_string_len(name) : 0;
        if (len == 0 || len > 1024 || memchr(json_object_get_string(name), 0, len) != NULL ||
            (names[i] = strdup(json_object_get_string(name))) == NULL) {
            for (size_t k = 0; k < i; k++)
                free(names[k]);
            free(names);
            return -1;
        }
    }
    free_names(program);
    program->kernel_names = names;
    program->num_kernels = n;
    return 0;
}

typedef struct build_notice {
    am_notice base;
    cl_program program; /* retained */
    void(CL_CALLBACK *fn)(cl_program, void *);
    void *data;
} build_notice;

static void run_build_notice(am_notice *notice) {
    build_notice *n = (build_notice *)notice;
    n->fn(n->program, n->data);
    am_program_release(n->program);
    free(n);
}

static void post_build_notice(cl_program program, void(CL_CALLBACK *notify)(cl_program, void *), void *data) {
    if (notify == NULL)
        return;
    build_notice *n = calloc(1, sizeof *n);
    if (n == NULL)
        return;
    n->base.run = run_build_notice;
    am_program_retain(program);
    n->program = program;
    n->fn = notify;
    n->data = data;
    am_ctx_post(program->context, &n->base);
}

static cl_int check_options(const char *options) {
    size_t len = strlen(options);
    return len > 4000 || !am_utf8_valid(options, len) ? CL_INVALID_BUILD_OPTIONS : CL_SUCCESS;
}

static cl_int check_devices(cl_context ctx, cl_uint num_devices, const cl_device_id *devices) {
    if ((num_devices == 0) != (devices == NULL))
        return CL_INVALID_VALUE;
    for (cl_uint i = 0; i < num_devices; i++)
        if (devices[i] != ctx->device)
            return CL_INVALID_DEVICE;
    return CL_SUCCESS;
}

/* Take the program for a build (none may be under way, nor kernels of it alive). */
static cl_int begin_build(cl_program program) {
    pthread_mutex_lock(&program->mu);
    if (atomic_load(&program->kernels) > 0 || program->status == CL_BUILD_IN_PROGRESS) {
        pthread_mutex_unlock(&program->mu);
        return CL_INVALID_OPERATION;
    }
    program->status = CL_BUILD_IN_PROGRESS;
    pthread_mutex_unlock(&program->mu);
    return CL_SUCCESS;
}

static void end_build(cl_program program, const char *log, const char *options) {
    pthread_mutex_lock(&program->mu);
    free(program->log);
    program->log = strdup(log);
    free(program->options);
    program->options = strdup(options);
    program->status = CL_BUILD_ERROR;
    pthread_mutex_unlock(&program->mu);
}

/* Build at the pool: `text` (a source, its includes resolved, or a device
 * binary) with `wire_options`; the application's `options` are what it
 * is told it built with.  The log, the kernel names and the state kept. */
static cl_int build_at_pool(cl_program program, const void *text, size_t len, bool from_source,
                            const char *wire_options_in, const char *options) {
    cl_context ctx = program->context;
    bool arg_info = strstr(options, ARG_INFO_OPTION) != NULL;
    uint64_t handle = am_session_handle(ctx->session);
    am_buf fields;
    am_buf_init(&fields);
    int rc = am_buf_printf(&fields, "\"prog\":%" PRIu64 ",\"options\":", handle);
    am_buf wire_options;
    am_buf_init(&wire_options);
    rc |= am_buf_puts(&wire_options, wire_options_in);
    if (!arg_info && from_source)
        rc |= am_buf_puts(&wire_options, wire_options_in[0] ? " " ARG_INFO_OPTION : ARG_INFO_OPTION);
    if (rc == 0)
        rc = am_buf_json_string(&fields, (const char *)wire_options.data, wire_options.len);
    am_buf_free(&wire_options);
    am_cmd *cmd = rc == 0 ? am_cmd_new(from_source ? "build" : "build_binary", (const char *)fields.data, text, len,
                                       false)
                          : NULL;
    am_buf_free(&fields);
    if (cmd == NULL) {
        end_build(program, "", options);
        return CL_OUT_OF_HOST_MEMORY;
    }
    am_cmd *done = NULL;
    cl_int err = am_call(ctx, cmd, CL_BUILD_PROGRAM_FAILURE, &done);
    const char *log = NULL;
    size_t log_len = 0;
    if (done != NULL && done->ok)
        log = am_json_str(done->reply, "log", &log_len);
    else if (done != NULL && done->reply != NULL)
        log = am_json_str(am_json_get(am_json_get(done->reply, "error"), "details"), "log", &log_len);
    if (done != NULL && !done->ok && log == NULL) { /* the pool's own refusal: its message is the log */
        log = done->error.message;
        log_len = strlen(log);
        if (strcmp(done->error.code, "BAD_REQUEST") == 0)
            err = strstr(done->error.message, "option") != NULL ? CL_INVALID_BUILD_OPTIONS : CL_BUILD_PROGRAM_FAILURE;
    }
    if (done != NULL && !done->ok && strcmp(done->error.code, "BUILD_FAILED") == 0)
        err = from_source ? CL_BUILD_PROGRAM_FAILURE : CL_INVALID_BINARY;
    pthread_mutex_lock(&program->mu);
    free(program->log);
    program->log = log != NULL ? strndup(log, log_len) : strdup("");
    free(program->options);
    program->options = strdup(options);
    uint64_t binary_size = 0;
    if (err == CL_SUCCESS && take_names(program, done->reply) != 0)
        err = CL_OUT_OF_HOST_MEMORY;
    if (err == CL_SUCCESS && am_json_u64(am_json_get(done->reply, "binary_size"), &binary_size))
        program->binary_size = (size_t)binary_size;
    uint64_t old = 0;
    if (err == CL_SUCCESS) {
        old = program->handle;
        program->handle = handle;
        program->arg_info = arg_info;
        program->status = CL_BUILD_SUCCESS;
        program->binary_type = CL_PROGRAM_BINARY_TYPE_EXECUTABLE;
    } else {
        program->status = CL_BUILD_ERROR;
    }
    pthread_mutex_unlock(&program->mu);
    am_cmd_free(done);
    if (old != 0)
        free_program_at_pool(ctx, old); /* the build before this one */
    return err;
}

static cl_int CL_API_CALL am_clBuildProgram(cl_program program, cl_uint num_devices, const cl_device_id *devices,
                                            const char *options, void(CL_CALLBACK *notify)(cl_program, void *),
                                            void *data) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    cl_int err = check_devices(program->context, num_devices, devices);
    if (err != CL_SUCCESS || (notify == NULL && data != NULL))
        return err != CL_SUCCESS ? err : CL_INVALID_VALUE;
    if (options == NULL)
        options = "";
    if ((err = check_options(options)) != CL_SUCCESS)
        return err;
    if (program->linked)
        return CL_INVALID_OPERATION; /* (made by a link: no source or binary of its own) */
    if ((err = begin_build(program)) != CL_SUCCESS)
        return err;
    if (program->binary != NULL) {
        err = build_at_pool(program, program->binary, program->binary_len, false, options, options);
    } else {
        am_buf text, wire_options;
        am_buf_init(&text);
        am_buf_init(&wire_options);
        char why[256];
        if (am_expand_includes(program->source, program->source_len, options, NULL, 0, &text, &wire_options, why,
                               sizeof why) != 0) {
            end_build(program, why, options);
            err = strcmp(why, "out of memory") == 0 ? CL_OUT_OF_HOST_MEMORY : CL_BUILD_PROGRAM_FAILURE;
        } else {
            err = build_at_pool(program, text.data, text.len, true, (const char *)wire_options.data, options);
        }
        am_buf_free(&text);
        am_buf_free(&wire_options);
    }
    post_build_notice(program, notify, data);
    return err;
}

static cl_int CL_API_CALL am_clCompileProgram(cl_program program, cl_uint num_devices, const cl_device_id *devices,
                                              const char *options, cl_uint num_headers, const cl_program *headers,
                                              const char **names, void(CL_CALLBACK *notify)(cl_program, void *),
                                              void *data) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    cl_int err = check_devices(program->context, num_devices, devices);
    if (err != CL_SUCCESS)
        return err;
    if ((notify == NULL && data != NULL) || (num_headers == 0) != (headers == NULL) ||
        (num_headers == 0) != (names == NULL))
        return CL_INVALID_VALUE;
    if (options == NULL)
        options = "";
    if ((err = check_options(options)) != CL_SUCCESS)
        return CL_INVALID_COMPILER_OPTIONS;
    if (program->source == NULL)
        return CL_INVALID_OPERATION; /* (only a program made from source compiles) */
    am_header *found = num_headers ? calloc(num_headers, sizeof *found) : NULL;
    if (num_headers && found == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    for (cl_uint i = 0; i < num_headers; i++) {
        if (!am_is_program(headers[i]) || headers[i]->source == NULL || names[i] == NULL) {
            free(found);
            return names[i] == NULL ? CL_INVALID_VALUE : CL_INVALID_OPERATION;
        }
        found[i] = (am_header){names[i], headers[i]->source, headers[i]->source_len};
    }
    if ((err = begin_build(program)) != CL_SUCCESS) {
        free(found);
        return err;
    }
    am_buf unit, unit_options;
    am_buf_init(&unit);
    am_buf_init(&unit_options);
    char why[256];
    int rc = am_expand_includes(program->source, program->source_len, options, found, num_headers, &unit,
                                &unit_options, why, sizeof why);
    free(found);
    if (rc != 0) {
        am_buf_free(&unit);
        am_buf_free(&unit_options);
        end_build(program, why, options);
        post_build_notice(program, notify, data);
        return strcmp(why, "out of memory") == 0 ? CL_OUT_OF_HOST_MEMORY : CL_COMPILE_PROGRAM_FAILURE;
    }
    pthread_mutex_lock(&program->mu);
    free(program->unit);
    free(program->unit_options);
    program->unit_len = unit.len;
    program->unit = (char *)am_buf_take(&unit);
    program->unit_options = (char *)am_buf_take(&unit_options);
    free(program->log);
    program->log = strdup("");
    free(program->options);
    program->options = strdup(options);
    program->binary_type = CL_PROGRAM_BINARY_TYPE_COMPILED_OBJECT;
    program->status = CL_BUILD_SUCCESS;
    pthread_mutex_unlock(&program->mu);
    am_buf_free(&unit);
    am_buf_free(&unit_options);
    post_build_notice(program, notify, data);
    return CL_SUCCESS;
}

/* One unit of a link: its macros defined around its text, its other options kept for the build. */
static int add_unit(cl_program unit, am_buf *text, am_buf *options) {
    am_buf defines, undefines, rest;
    am_buf_init(&defines);
    am_buf_init(&undefines);
    am_buf_init(&rest);
    int rc = am_split_defines(unit->unit_options != NULL ? unit->unit_options : "", &defines, &undefines, &rest);
    if (defines.len)
        rc |= am_buf_append(text, defines.data, defines.len);
    rc |= am_buf_puts(text, "#line 1 \"input.cl\"\n");
    rc |= am_buf_append(text, unit->unit, unit->unit_len);
    if (unit->unit_len == 0 || unit->unit[unit->unit_len - 1] != '\n')
        rc |= am_buf_puts(text, "\n");
    if (undefines.len)
        rc |= am_buf_append(text, undefines.data, undefines.len);
    /* the units' other options, each once */
    if (rest.len && (options->data == NULL || strstr((const char *)options->data, (const char *)rest.data) == NULL)) {
        rc |= am_buf_puts(options, options->len ? " " : "");
        rc |= am_buf_append(options, rest.data, rest.len);
        rc |= am_buf_append(options, "", 1);
        options->len--;
    }
    am_buf_free(&defines);
    am_buf_free(&undefines);
    am_buf_free(&rest);
    return rc;
}

static cl_program CL_API_CALL am_clLinkProgram(cl_context ctx, cl_uint num_devices, const cl_device_id *devices,
                                               const char *options, cl_uint num_programs, const cl_program *programs,
                                               void(CL_CALLBACK *notify)(cl_program, void *), void *data,
                                               cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_program linked = NULL;
    am_buf text, wire_options;
    am_buf_init(&text);
    am_buf_init(&wire_options);
    if (!am_is_context(ctx)) {
        err = CL_INVALID_CONTEXT;
        goto out;
    }
    if ((err = check_devices(ctx, num_devices, devices)) != CL_SUCCESS)
        goto out;
    if (num_programs == 0 || programs == NULL || (notify == NULL && data != NULL)) {
        err = CL_INVALID_VALUE;
        goto out;
    }
    if (options == NULL)
        options = "";
    if (check_options(options) != CL_SUCCESS) {
        err = CL_INVALID_LINKER_OPTIONS;
        goto out;
    }
    bool library = strstr(options, "-create-library") != NULL;
    for (cl_uint i = 0; i < num_programs && err == CL_SUCCESS; i++) {
        cl_program unit = programs[i];
        if (!am_is_program(unit) || unit->context != ctx) {
            err = CL_INVALID_PROGRAM;
            break;
        }
        pthread_mutex_lock(&unit->mu);
        bool usable = unit->status == CL_BUILD_SUCCESS && unit->unit != NULL &&
                      (unit->binary_type == CL_PROGRAM_BINARY_TYPE_COMPILED_OBJECT ||
                       unit->binary_type == CL_PROGRAM_BINARY_TYPE_LIBRARY);
        if (!usable)
            err = CL_INVALID_OPERATION;
        else if (add_unit(unit, &text, &wire_options) != 0)
            err = CL_OUT_OF_HOST_MEMORY;
        pthread_mutex_unlock(&unit->mu);
    }
    if (err != CL_SUCCESS)
        goto out;
    if ((linked = make_program(ctx)) == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto out;
    }
    linked->linked = true;
    if (library) {
        /* a library is its units, kept for a later link */
        linked->unit_len = text.len;
        linked->unit = text.len ? (char *)am_buf_take(&text) : strdup("");
        linked->unit_options = strdup("");
        linked->options = strdup(options);
        linked->log = strdup("");
        linked->binary_type = CL_PROGRAM_BINARY_TYPE_LIBRARY;
        linked->status = CL_BUILD_SUCCESS;
    } else {
        /* the link's options go with the units' (-cl-kernel-arg-info added as for any build) */
        am_buf all;
        am_buf_init(&all);
        int rc = am_buf_puts(&all, options);
        if (wire_options.len) {
            rc |= am_buf_puts(&all, options[0] ? " " : "");
            rc |= am_buf_append(&all, wire_options.data, wire_options.len);
        }
        rc |= am_buf_append(&all, "", 1);
        if (rc != 0 || begin_build(linked) != CL_SUCCESS) {
            err = CL_OUT_OF_HOST_MEMORY;
        } else {
            err = build_at_pool(linked, text.data, text.len, true, (const char *)all.data, options);
            if (err == CL_BUILD_PROGRAM_FAILURE)
                err = CL_LINK_PROGRAM_FAILURE; /* (the program is returned: its log says why) */
        }
        am_buf_free(&all);
    }
    post_build_notice(linked, notify, data);
out:
    am_buf_free(&text);
    am_buf_free(&wire_options);
    if (errcode != NULL)
        *errcode = err;
    if (linked != NULL && err != CL_SUCCESS && err != CL_LINK_PROGRAM_FAILURE) {
        am_program_release(linked);
        linked = NULL;
    }
    return linked;
}

static cl_int CL_API_CALL am_clRetainProgram(cl_program program) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    am_program_retain(program);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseProgram(cl_program program) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    am_program_release(program);
    return CL_SUCCESS;
}

/* The program's device binary, as its runtime gives it (program_binary). */
static cl_int fetch_binary(cl_program program, uint64_t handle, unsigned char *out, size_t size) {
    char fields[48];
    snprintf(fields, sizeof fields, "\"prog\":%" PRIu64, handle);
    am_cmd *cmd = am_cmd_new("program_binary", fields, NULL, 0, false);
    if (cmd == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    cmd->sink = out;
    cmd->sink_len = size;
    am_cmd *done = NULL;
    cl_int err = am_call(program->context, cmd, CL_OUT_OF_RESOURCES, &done);
    if (err == CL_SUCCESS && !done->payload_in_sink)
        err = CL_OUT_OF_RESOURCES; /* its size is not the one the build said */
    am_cmd_free(done);
    return err;
}

static cl_int CL_API_CALL am_clGetProgramInfo(cl_program program, cl_program_info param, size_t size, void *value,
                                              size_t *size_ret) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    cl_context ctx = program->context;
    cl_int err;
    pthread_mutex_lock(&program->mu);
    bool built = program->status == CL_BUILD_SUCCESS;
    switch (param) {
    case CL_PROGRAM_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&program->refs);
        err = am_answer(size, value, size_ret, &refs, sizeof refs);
        break;
    }
    case CL_PROGRAM_CONTEXT:
        err = am_answer(size, value, size_ret, &ctx, sizeof ctx);
        break;
    case CL_PROGRAM_NUM_DEVICES: {
        cl_uint one = 1;
        err = am_answer(size, value, size_ret, &one, sizeof one);
        break;
    }
    case CL_PROGRAM_DEVICES:
        err = am_answer(size, value, size_ret, &ctx->device, sizeof ctx->device);
        break;
    case CL_PROGRAM_SOURCE:
        err = program->source != NULL ? am_answer(size, value, size_ret, program->source, program->source_len + 1)
                                      : am_answer_str(size, value, size_ret, "");
        break;
    case CL_PROGRAM_IL:
        err = am_answer(size, value, size_ret, NULL, 0);
        break;
    case CL_PROGRAM_BINARY_SIZES: {
        size_t binary = built ? program->binary_size : 0;
        err = am_answer(size, value, size_ret, &binary, sizeof binary);
        break;
    }
    case CL_PROGRAM_BINARIES: {
        /* an array of one pointer, the caller's, to fill with the binary */
        err = value != NULL && size < sizeof(unsigned char *) ? CL_INVALID_VALUE : CL_SUCCESS;
        if (size_ret != NULL)
            *size_ret = sizeof(unsigned char *);
        if (err == CL_SUCCESS && value != NULL) {
            unsigned char *out = ((unsigned char **)value)[0];
            uint64_t handle = program->handle;
            size_t binary = program->binary_size;
            pthread_mutex_unlock(&program->mu);
            return built && out != NULL && binary ? fetch_binary(program, handle, out, binary) : CL_SUCCESS;
        }
        break;
    }
    case CL_PROGRAM_NUM_KERNELS: {
        size_t n = program->num_kernels;
        err = built ? am_answer(size, value, size_ret, &n, sizeof n) : CL_INVALID_PROGRAM_EXECUTABLE;
        break;
    }
    case CL_PROGRAM_KERNEL_NAMES: {
        if (!built) {
            err = CL_INVALID_PROGRAM_EXECUTABLE;
            break;
        }
        am_buf names;
        am_buf_init(&names);
        int rc = am_buf_puts(&names, "");
        for (size_t i = 0; i < program->num_kernels; i++)
            rc |= am_buf_puts(&names, i ? ";" : "") | am_buf_puts(&names, program->kernel_names[i]);
        err = rc == 0 ? am_answer_str(size, value, size_ret, (const char *)names.data) : CL_OUT_OF_HOST_MEMORY;
        am_buf_free(&names);
        break;
    }
    case CL_PROGRAM_SCOPE_GLOBAL_CTORS_PRESENT:
    case CL_PROGRAM_SCOPE_GLOBAL_DTORS_PRESENT: {
        cl_bool no = CL_FALSE;
        err = am_answer(size, value, size_ret, &no, sizeof no);
        break;
    }
    default:
        err = CL_INVALID_VALUE;
    }
    pthread_mutex_unlock(&program->mu);
    return err;
}

static cl_int CL_API_CALL am_clGetProgramBuildInfo(cl_program program, cl_device_id device,
                                                   cl_program_build_info param, size_t size, void *value,
                                                   size_t *size_ret) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    if (device != program->context->device)
        return CL_INVALID_DEVICE;
    cl_int err;
    pthread_mutex_lock(&program->mu);
    switch (param) {
    case CL_PROGRAM_BUILD_STATUS:
        err = am_answer(size, value, size_ret, &program->status, sizeof program->status);
        break;
    case CL_PROGRAM_BUILD_OPTIONS:
        err = am_answer_str(size, value, size_ret, program->options != NULL ? program->options : "");
        break;
    case CL_PROGRAM_BUILD_LOG:
        err = am_answer_str(size, value, size_ret, program->log != NULL ? program->log : "");
        break;
    case CL_PROGRAM_BINARY_TYPE: {
        cl_program_binary_type type =
            program->status == CL_BUILD_SUCCESS ? program->binary_type : CL_PROGRAM_BINARY_TYPE_NONE;
        err = am_answer(size, value, size_ret, &type, sizeof type);
        break;
    }
    case CL_PROGRAM_BUILD_GLOBAL_VARIABLE_TOTAL_SIZE: {
        size_t none = 0;
        err = am_answer(size, value, size_ret, &none, sizeof none);
        break;
    }
    default:
        err = CL_INVALID_VALUE;
    }
    pthread_mutex_unlock(&program->mu);
    return err;
}

static cl_int CL_API_CALL am_clSetProgramReleaseCallback(cl_program program, void(CL_CALLBACK *fn)(cl_program, void *),
                                                         void *data) {
    (void)fn, (void)data;
    return am_is_program(program) ? CL_INVALID_OPERATION : CL_INVALID_PROGRAM; /* (deprecated: 3.0 allows this) */
}

static cl_int CL_API_CALL am_clSetProgramSpecializationConstant(cl_program program, cl_uint id, size_t size,
                                                                const void *value) {
    (void)id, (void)size, (void)value;
    return am_is_program(program) ? CL_INVALID_OPERATION : CL_INVALID_PROGRAM; /* no IL programs */
}

/* -- kernels ---------------------------------------------------------------------------- */

void am_kernel_retain(cl_kernel kernel) {
    atomic_fetch_add(&kernel->refs, 1);
}

static void free_kernel(cl_kernel kernel) {
    for (cl_uint i = 0; kernel->args != NULL && i < kernel->num_args; i++)
        free(kernel->args[i].big);
    for (cl_uint i = 0; kernel->arg_info != NULL && i < kernel->num_args; i++) {
        free(kernel->arg_info[i].type_name);
        free(kernel->arg_info[i].name);
    }
    free(kernel->args);
    free(kernel->arg_info);
    free(kernel->name);
    free(kernel->attributes);
    pthread_mutex_destroy(&kernel->mu);
    free(kernel);
}

void am_kernel_release(cl_kernel kernel) {
    if (atomic_fetch_sub(&kernel->refs, 1) != 1)
        return;
    cl_program program = kernel->program;
    kernel->magic = AM_MAGIC_DEAD;
    free_kernel(kernel);
    atomic_fetch_sub(&program->kernels, 1);
    am_program_release(program);
}

static bool take_size(json_object *obj, const char *key, size_t *out) {
    uint64_t value;
    if (!am_json_u64_max(am_json_get(obj, key), SIZE_MAX, &value))
        return false;
    *out = (size_t)value;
    return true;
}

/* A kernel_info answer into `kernel` (bounded and checked: the pool's word). */
static int take_kernel_info(cl_kernel kernel, json_object *info) {
    uint64_t nargs;
    json_object *args = am_json_get(info, "args");
    json_object *wg = am_json_get(info, "work_group");
    size_t attributes_len = 0;
    const char *attributes = am_json_str(info, "attributes", &attributes_len);
    if (!am_json_u64_max(am_json_get(info, "num_args"), MAX_KERNEL_ARGS, &nargs) || args == NULL ||
        !json_object_is_type(args, json_type_array) || json_object_array_length(args) != nargs || wg == NULL ||
        attributes == NULL || attributes_len > 4096)
        return -1;
    kernel->num_args = (cl_uint)nargs;
    kernel->attributes = strndup(attributes, attributes_len);
    kernel->args = calloc(nargs ? nargs : 1, sizeof *kernel->args);
    if (kernel->attributes == NULL || kernel->args == NULL)
        return -1;
    uint64_t local_mem = 0, private_mem = 0;
    json_object *compile = am_json_get(wg, "compile_size");
    if (!take_size(wg, "size", &kernel->wg_size) || !take_size(wg, "preferred_multiple", &kernel->preferred_multiple) ||
        !am_json_u64(am_json_get(wg, "local_mem"), &local_mem) ||
        !am_json_u64(am_json_get(wg, "private_mem"), &private_mem) || compile == NULL ||
        !json_object_is_type(compile, json_type_array) || json_object_array_length(compile) != 3)
        return -1;
    kernel->local_mem = local_mem;
    kernel->private_mem = private_mem;
    for (size_t i = 0; i < 3; i++) {
        uint64_t v;
        if (!am_json_u64_max(json_object_array_get_idx(compile, i), SIZE_MAX, &v))
            return -1;
        kernel->compile_size[i] = (size_t)v;
    }
    bool complete = nargs > 0;
    for (size_t i = 0; i < nargs && complete; i++)
        complete = json_object_is_type(json_object_array_get_idx(args, i), json_type_object);
    if (!complete)
        return 0; /* no argument information (a binary built without it) */
    kernel->arg_info = calloc(nargs, sizeof *kernel->arg_info);
    if (kernel->arg_info == NULL)
        return -1;
    for (size_t i = 0; i < nargs; i++) {
        json_object *arg = json_object_array_get_idx(args, i);
        uint64_t address, access, qualifier;
        size_t type_len = 0, name_len = 0;
        const char *type = am_json_str(arg, "type", &type_len);
        const char *name = am_json_str(arg, "name", &name_len);
        if (!am_json_u64_max(am_json_get(arg, "address"), UINT32_MAX, &address) ||
            !am_json_u64_max(am_json_get(arg, "access"), UINT32_MAX, &access) ||
            !am_json_u64(am_json_get(arg, "type_qualifier"), &qualifier) || type == NULL || name == NULL ||
            type_len > 256 || name_len > 256)
            return -1;
        kernel->arg_info[i].address = (cl_kernel_arg_address_qualifier)address;
        kernel->arg_info[i].access = (cl_kernel_arg_access_qualifier)access;
        kernel->arg_info[i].type_qualifier = qualifier;
        kernel->arg_info[i].type_name = strndup(type, type_len);
        kernel->arg_info[i].name = strndup(name, name_len);
        if (kernel->arg_info[i].type_name == NULL || kernel->arg_info[i].name == NULL)
            return -1;
    }
    return 0;
}

static cl_kernel create_kernel(cl_program program, const char *name, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_kernel kernel = NULL;
    pthread_mutex_lock(&program->mu);
    bool built = program->status == CL_BUILD_SUCCESS;
    bool known = false;
    for (size_t i = 0; built && i < program->num_kernels && !known; i++)
        known = strcmp(program->kernel_names[i], name) == 0;
    uint64_t handle = program->handle;
    pthread_mutex_unlock(&program->mu);
    if (!built) {
        err = CL_INVALID_PROGRAM_EXECUTABLE;
        goto out;
    }
    if (!known) {
        err = CL_INVALID_KERNEL_NAME;
        goto out;
    }
    am_buf fields;
    am_buf_init(&fields);
    int rc = am_buf_printf(&fields, "\"prog\":%" PRIu64 ",\"kernel\":", handle);
    rc |= am_buf_json_string(&fields, name, strlen(name));
    am_cmd *cmd = rc == 0 ? am_cmd_new("kernel_info", (const char *)fields.data, NULL, 0, false) : NULL;
    am_buf_free(&fields);
    if (cmd == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
        goto out;
    }
    am_cmd *done = NULL;
    if ((err = am_call(program->context, cmd, CL_INVALID_KERNEL_DEFINITION, &done)) != CL_SUCCESS) {
        am_cmd_free(done);
        goto out;
    }
    kernel = calloc(1, sizeof *kernel);
    if (kernel == NULL || (kernel->name = strdup(name)) == NULL) {
        err = CL_OUT_OF_HOST_MEMORY;
    } else {
        pthread_mutex_init(&kernel->mu, NULL);
        if (take_kernel_info(kernel, am_json_get(done->reply, "kernel")) != 0) {
            am_warn("kernel %s: the pool's kernel information is unusable", name);
            err = CL_OUT_OF_RESOURCES;
        }
    }
    am_cmd_free(done);
    if (err != CL_SUCCESS) {
        if (kernel != NULL && kernel->name != NULL)
            free_kernel(kernel);
        else
            free(kernel);
        kernel = NULL;
        goto out;
    }
    kernel->dispatch = &am_dispatch;
    atomic_init(&kernel->refs, 1);
    kernel->program = program;
    am_program_retain(program);
    atomic_fetch_add(&program->kernels, 1);
    kernel->magic = AM_MAGIC_KERNEL;
out:
    if (errcode != NULL)
        *errcode = err;
    return kernel;
}

static cl_kernel CL_API_CALL am_clCreateKernel(cl_program program, const char *name, cl_int *errcode) {
    if (!am_is_program(program)) {
        if (errcode != NULL)
            *errcode = CL_INVALID_PROGRAM;
        return NULL;
    }
    if (name == NULL) {
        if (errcode != NULL)
            *errcode = CL_INVALID_VALUE;
        return NULL;
    }
    return create_kernel(program, name, errcode);
}

static cl_int CL_API_CALL am_clCreateKernelsInProgram(cl_program program, cl_uint num, cl_kernel *kernels,
                                                      cl_uint *num_ret) {
    if (!am_is_program(program))
        return CL_INVALID_PROGRAM;
    pthread_mutex_lock(&program->mu);
    bool built = program->status == CL_BUILD_SUCCESS;
    size_t count = program->num_kernels;
    char **names = NULL;
    if (built && count) {
        names = calloc(count, sizeof *names);
        for (size_t i = 0; names != NULL && i < count; i++)
            names[i] = strdup(program->kernel_names[i]);
    }
    pthread_mutex_unlock(&program->mu);
    cl_int err = CL_SUCCESS;
    if (!built)
        err = CL_INVALID_PROGRAM_EXECUTABLE;
    else if (kernels != NULL && num < count)
        err = CL_INVALID_VALUE;
    else if (count && names == NULL)
        err = CL_OUT_OF_HOST_MEMORY;
    for (size_t i = 0; err == CL_SUCCESS && kernels != NULL && i < count; i++) {
        kernels[i] = names[i] != NULL ? create_kernel(program, names[i], &err) : NULL;
        if (names[i] == NULL)
            err = CL_OUT_OF_HOST_MEMORY;
        if (err != CL_SUCCESS)
            for (size_t k = 0; k < i; k++)
                am_kernel_release(kernels[k]);
    }
    for (size_t i = 0; names != NULL && i < count; i++)
        free(names[i]);
    free(names);
    if (err == CL_SUCCESS && num_ret != NULL)
        *num_ret = (cl_uint)count;
    return err;
}

static cl_int CL_API_CALL am_clRetainKernel(cl_kernel kernel) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    am_kernel_retain(kernel);
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clReleaseKernel(cl_kernel kernel) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    am_kernel_release(kernel);
    return CL_SUCCESS;
}

static cl_int set_raw(am_arg *arg, size_t size, const void *value) {
    if (size == 0 || size > MAX_RAW_ARG)
        return CL_INVALID_ARG_SIZE;
    uint8_t *big = NULL;
    if (size > sizeof arg->raw && (big = malloc(size)) == NULL)
        return CL_OUT_OF_HOST_MEMORY;
    free(arg->big);
    arg->big = big;
    memcpy(big != NULL ? big : arg->raw, value, size);
    arg->kind = AM_ARG_RAW;
    arg->size = size;
    return CL_SUCCESS;
}

static cl_int set_buffer(cl_kernel kernel, am_arg *arg, size_t size, const void *value) {
    if (size != sizeof(cl_mem))
        return CL_INVALID_ARG_SIZE;
    cl_mem mem = value != NULL ? *(const cl_mem *)value : NULL;
    if (mem == NULL) {
        arg->kind = AM_ARG_NULL;
        return CL_SUCCESS;
    }
    if (!am_is_mem(mem) || mem->context != kernel->program->context)
        return CL_INVALID_MEM_OBJECT;
    free(arg->big);
    arg->big = NULL;
    arg->kind = AM_ARG_BUFFER;
    arg->mem = mem;
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clSetKernelArg(cl_kernel kernel, cl_uint index, size_t size, const void *value) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    if (index >= kernel->num_args)
        return CL_INVALID_ARG_INDEX;
    cl_int err;
    pthread_mutex_lock(&kernel->mu);
    am_arg *arg = &kernel->args[index];
    if (kernel->arg_info != NULL) {
        const am_arg_info *info = &kernel->arg_info[index];
        switch (info->address) {
        case CL_KERNEL_ARG_ADDRESS_GLOBAL:
        case CL_KERNEL_ARG_ADDRESS_CONSTANT:
            err = set_buffer(kernel, arg, size, value);
            break;
        case CL_KERNEL_ARG_ADDRESS_LOCAL:
            if (value != NULL)
                err = CL_INVALID_ARG_VALUE;
            else if (size == 0)
                err = CL_INVALID_ARG_SIZE;
            else {
                arg->kind = AM_ARG_LOCAL;
                arg->size = size;
                err = CL_SUCCESS;
            }
            break;
        default:
            if (strcmp(info->type_name, "sampler_t") == 0)
                err = CL_INVALID_SAMPLER; /* no samplers: no images */
            else
                err = value == NULL ? CL_INVALID_ARG_VALUE : set_raw(arg, size, value);
        }
    } else if (value == NULL) {
        /* no argument information: what OpenCL's rules leave one reading of */
        arg->kind = size ? AM_ARG_LOCAL : AM_ARG_UNSET;
        arg->size = size;
        err = size ? CL_SUCCESS : CL_INVALID_ARG_SIZE;
    } else if (size == sizeof(cl_mem) && am_ctx_has_mem(kernel->program->context, *(const void *const *)value)) {
        err = set_buffer(kernel, arg, size, value);
    } else {
        err = set_raw(arg, size, value);
    }
    pthread_mutex_unlock(&kernel->mu);
    return err;
}

static cl_int CL_API_CALL am_clGetKernelInfo(cl_kernel kernel, cl_kernel_info param, size_t size, void *value,
                                             size_t *size_ret) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    switch (param) {
    case CL_KERNEL_FUNCTION_NAME:
        return am_answer_str(size, value, size_ret, kernel->name);
    case CL_KERNEL_NUM_ARGS:
        return am_answer(size, value, size_ret, &kernel->num_args, sizeof kernel->num_args);
    case CL_KERNEL_REFERENCE_COUNT: {
        cl_uint refs = (cl_uint)atomic_load(&kernel->refs);
        return am_answer(size, value, size_ret, &refs, sizeof refs);
    }
    case CL_KERNEL_CONTEXT:
        return am_answer(size, value, size_ret, &kernel->program->context, sizeof(cl_context));
    case CL_KERNEL_PROGRAM:
        return am_answer(size, value, size_ret, &kernel->program, sizeof kernel->program);
    case CL_KERNEL_ATTRIBUTES:
        return am_answer_str(size, value, size_ret, kernel->attributes);
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_int CL_API_CALL am_clGetKernelWorkGroupInfo(cl_kernel kernel, cl_device_id device,
                                                      cl_kernel_work_group_info param, size_t size, void *value,
                                                      size_t *size_ret) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    if (device != NULL && device != kernel->program->context->device)
        return CL_INVALID_DEVICE;
    switch (param) {
    case CL_KERNEL_WORK_GROUP_SIZE:
        return am_answer(size, value, size_ret, &kernel->wg_size, sizeof kernel->wg_size);
    case CL_KERNEL_COMPILE_WORK_GROUP_SIZE:
        return am_answer(size, value, size_ret, kernel->compile_size, sizeof kernel->compile_size);
    case CL_KERNEL_LOCAL_MEM_SIZE:
        return am_answer(size, value, size_ret, &kernel->local_mem, sizeof kernel->local_mem);
    case CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE:
        return am_answer(size, value, size_ret, &kernel->preferred_multiple, sizeof kernel->preferred_multiple);
    case CL_KERNEL_PRIVATE_MEM_SIZE:
        return am_answer(size, value, size_ret, &kernel->private_mem, sizeof kernel->private_mem);
    default:
        return CL_INVALID_VALUE; /* (CL_KERNEL_GLOBAL_WORK_SIZE: custom devices and built-in kernels only) */
    }
}

static cl_int CL_API_CALL am_clGetKernelArgInfo(cl_kernel kernel, cl_uint index, cl_kernel_arg_info param,
                                                size_t size, void *value, size_t *size_ret) {
    if (!am_is_kernel(kernel))
        return CL_INVALID_KERNEL;
    if (index >= kernel->num_args)
        return CL_INVALID_ARG_INDEX;
    /* as the runtime does: only for a program built with -cl-kernel-arg-info */
    if (kernel->arg_info == NULL || !kernel->program->arg_info)
        return CL_KERNEL_ARG_INFO_NOT_AVAILABLE;
    const am_arg_info *info = &kernel->arg_info[index];
    switch (param) {
    case CL_KERNEL_ARG_ADDRESS_QUALIFIER:
        return am_answer(size, value, size_ret, &info->address, sizeof info->address);
    case CL_KERNEL_ARG_ACCESS_QUALIFIER:
        return am_answer(size, value, size_ret, &info->access, sizeof info->access);
    case CL_KERNEL_ARG_TYPE_NAME:
        return am_answer_str(size, value, size_ret, info->type_name);
    case CL_KERNEL_ARG_TYPE_QUALIFIER:
        return am_answer(size, value, size_ret, &info->type_qualifier, sizeof info->type_qualifier);
    case CL_KERNEL_ARG_NAME:
        return am_answer_str(size, value, size_ret, info->name);
    default:
        return CL_INVALID_VALUE;
    }
}

static cl_kernel CL_API_CALL am_clCloneKernel(cl_kernel source, cl_int *errcode) {
    cl_int err = CL_SUCCESS;
    cl_kernel kernel = NULL;
    if (!am_is_kernel(source)) {
        err = CL_INVALID_KERNEL;
        goto out;
    }
    kernel = create_kernel(source->program, source->name, &err);
    if (kernel == NULL)
        goto out;
    pthread_mutex_lock(&source->mu);
    for (cl_uint i = 0; i < kernel->num_args && err == CL_SUCCESS; i++) {
        am_arg *from = &source->args[i], *to = &kernel->args[i];
        *to = *from;
        to->big = NULL;
        if (from->kind == AM_ARG_RAW && from->big != NULL) {
            to->big = malloc(from->size);
            if (to->big == NULL)
                err = CL_OUT_OF_HOST_MEMORY;
            else
                memcpy(to->big, from->big, from->size);
        }
    }
    pthread_mutex_unlock(&source->mu);
    if (err != CL_SUCCESS) {
        am_kernel_release(kernel);
        kernel = NULL;
    }
out:
    if (errcode != NULL)
        *errcode = err;
    return kernel;
}

static cl_int CL_API_CALL am_clGetKernelSubGroupInfo(cl_kernel kernel, cl_device_id device,
                                                     cl_kernel_sub_group_info param, size_t in_size,
                                                     const void *in_value, size_t size, void *value,
                                                     size_t *size_ret) {
    (void)device, (void)param, (void)in_size, (void)in_value, (void)size, (void)value, (void)size_ret;
    return am_is_kernel(kernel) ? CL_INVALID_OPERATION : CL_INVALID_KERNEL; /* no sub-group queries */
}

static cl_int CL_API_CALL am_clSetKernelExecInfo(cl_kernel kernel, cl_kernel_exec_info param, size_t size,
                                                 const void *value) {
    (void)param, (void)size, (void)value;
    return am_is_kernel(kernel) ? CL_INVALID_OPERATION : CL_INVALID_KERNEL; /* (SVM only) */
}

static cl_int CL_API_CALL am_clSetKernelArgSVMPointer(cl_kernel kernel, cl_uint index, const void *value) {
    (void)index, (void)value;
    return am_is_kernel(kernel) ? CL_INVALID_OPERATION : CL_INVALID_KERNEL;
}

void am_program_functions(cl_icd_dispatch *d);
void am_program_functions(cl_icd_dispatch *d) {
    d->clCreateProgramWithSource = am_clCreateProgramWithSource;
    d->clCreateProgramWithBinary = am_clCreateProgramWithBinary;
    d->clCreateProgramWithBuiltInKernels = am_clCreateProgramWithBuiltInKernels;
    d->clCreateProgramWithIL = am_clCreateProgramWithIL;
    d->clBuildProgram = am_clBuildProgram;
    d->clCompileProgram = am_clCompileProgram;
    d->clLinkProgram = am_clLinkProgram;
    d->clRetainProgram = am_clRetainProgram;
    d->clReleaseProgram = am_clReleaseProgram;
    d->clGetProgramInfo = am_clGetProgramInfo;
    d->clGetProgramBuildInfo = am_clGetProgramBuildInfo;
    d->clSetProgramReleaseCallback = am_clSetProgramReleaseCallback;
    d->clSetProgramSpecializationConstant = am_clSetProgramSpecializationConstant;
    d->clCreateKernel = am_clCreateKernel;
    d->clCreateKernelsInProgram = am_clCreateKernelsInProgram;
    d->clRetainKernel = am_clRetainKernel;
    d->clReleaseKernel = am_clReleaseKernel;
    d->clSetKernelArg = am_clSetKernelArg;
    d->clGetKernelInfo = am_clGetKernelInfo;
    d->clGetKernelWorkGroupInfo = am_clGetKernelWorkGroupInfo;
    d->clGetKernelArgInfo = am_clGetKernelArgInfo;
    d->clCloneKernel = am_clCloneKernel;
    d->clGetKernelSubGroupInfo = am_clGetKernelSubGroupInfo;
    d->clSetKernelExecInfo = am_clSetKernelExecInfo;
    d->clSetKernelArgSVMPointer = am_clSetKernelArgSVMPointer;
}

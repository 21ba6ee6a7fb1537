#include "errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "json.h"

void am_error_set(am_error *err, const char *code, const char *fmt, ...) {
    snprintf(err->code, sizeof err->code, "%s", code);
    va_list args;
    va_start(args, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, args);
    va_end(args);
    err->cl_error = 0;
}

void am_error_from_wire(am_error *err, json_object *error) {
    const char *code = am_json_str(error, "code", NULL);
    const char *message = am_json_str(error, "message", NULL);
    am_error_set(err, code != NULL ? code : "INTERNAL", "%s", message != NULL ? message : "(no message)");
    int64_t cl;
    json_object *details = am_json_get(error, "details");
    if (am_json_i64(am_json_get(details, "cl_error"), &cl) && cl < 0 && cl >= -2000)
        err->cl_error = (cl_int)cl;
}

bool am_error_terminal(const am_error *err) {
    static const char *const terminal[] = {"SESSION_LOST", "SESSION_EXPIRED", "SESSION_DIVERGED",
                                           "STALE_EPOCH", "KILLED"};
    for (size_t i = 0; i < sizeof terminal / sizeof *terminal; i++)
        if (strcmp(err->code, terminal[i]) == 0)
            return true;
    return false;
}

cl_int am_error_to_cl(const am_error *err, cl_int fallback) {
    static const struct {
        const char *code;
        cl_int cl;
    } table[] = {
        {"QUOTA_EXCEEDED", CL_MEM_OBJECT_ALLOCATION_FAILURE},
        {"OUT_OF_RANGE", CL_INVALID_VALUE},
        {"NO_SUCH_OBJECT", CL_INVALID_MEM_OBJECT},
        {"BUILD_FAILED", CL_BUILD_PROGRAM_FAILURE},
        {"KILLED", CL_OUT_OF_RESOURCES},
        {"SESSION_LOST", CL_OUT_OF_RESOURCES},
        {"SESSION_EXPIRED", CL_OUT_OF_RESOURCES},
        {"SESSION_DIVERGED", CL_OUT_OF_RESOURCES},
        {"STALE_EPOCH", CL_OUT_OF_RESOURCES},
        /* (the pool gone, refused, timed out: the caller's own "it failed",
         * CL_OUT_OF_RESOURCES for a command; clCreateContext says
         * CL_DEVICE_NOT_AVAILABLE itself) */
    };
    if (err->cl_error < 0)
        return err->cl_error; /* the runtime said exactly what went wrong */
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (strcmp(err->code, table[i].code) == 0)
            return table[i].cl;
    return fallback;
}

/* accelmig's wire error codes (wire/errors.py) as OpenCL sees them. */
#ifndef ACCELMIG_ERRORS_H
#define ACCELMIG_ERRORS_H

#include <CL/cl.h>
#include <json-c/json.h>
#include <stdbool.h>

typedef struct am_error {
    char code[32];     /* "BAD_REQUEST", ... ("" for none) */
    char message[512];
    cl_int cl_error;   /* details.cl_error: the runtime's own code, when the pool had one (0: none) */
} am_error;

void am_error_set(am_error *err, const char *code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* From an error object of the wire ({"code", "message", "details"}). */
void am_error_from_wire(am_error *err, json_object *error);
/* The session cannot go on after it (wire/errors.py TERMINAL_SESSION_CODES). */
bool am_error_terminal(const am_error *err);
/* What an application gets for a command that failed with `err` (`fallback`
 * when nothing better fits: the call's own "it failed" code). */
cl_int am_error_to_cl(const am_error *err, cl_int fallback);

#endif

/* A device's CL_DEVICE_* values as the pool read them from its runtime
 * (wire/opencl.py: DEVICE_PARAMS, the same table: a test holds them equal),
 * decoded once into the exact bytes clGetDeviceInfo answers, then changed
 * where this driver offers less than the device (am_devparams_restrict):
 * no images, no SVM, no pipes, no device-side enqueue, no sub-devices, no
 * built-in or native kernels, no unified host memory (the device is over a
 * network), and only the extensions that need nothing of the host API. */
#ifndef ACCELMIG_DEVPARAMS_H
#define ACCELMIG_DEVPARAMS_H

#include <CL/cl.h>
#include <json-c/json.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    AM_KIND_UINT, AM_KIND_BOOL, AM_KIND_ULONG, AM_KIND_SIZE, AM_KIND_STR, AM_KIND_SIZES, AM_KIND_PROPS,
    AM_KIND_VERSIONS
} am_param_kind;

typedef struct am_param_spec {
    const char *name;
    cl_device_info code;
    am_param_kind kind;
} am_param_spec;

extern const am_param_spec AM_DEVICE_PARAMS[];
extern const size_t AM_DEVICE_PARAM_COUNT;
const char *am_param_kind_name(am_param_kind kind);

typedef struct am_param_value {
    cl_device_info code;
    uint8_t *bytes;  /* owned */
    size_t len;
} am_param_value;

typedef struct am_devparams {
    am_param_value *values; /* owned, one per parameter the pool gave (or this driver set) */
    size_t count;
} am_devparams;

/* From a device's "cl" object: every known parameter whose value fits its
 * kind (anything else is left out, as the pool leaves out what its runtime
 * refused: clGetDeviceInfo then says CL_INVALID_VALUE).  -1: out of memory. */
int am_devparams_decode(am_devparams *params, json_object *cl);
void am_devparams_restrict(am_devparams *params);
const am_param_value *am_devparams_get(const am_devparams *params, cl_device_info code);
void am_devparams_free(am_devparams *params);
/* Convenience readers (0 / "" when absent). */
uint64_t am_devparams_uint(const am_devparams *params, cl_device_info code);
const char *am_devparams_str(const am_devparams *params, cl_device_info code);

#endif

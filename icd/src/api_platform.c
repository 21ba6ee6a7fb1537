/* The platform and its devices: what the loader asks first (the ICD entry
 * points), platform and device queries, and the device listing from the
 * pool (once, at the first clGetDeviceIDs that reaches it). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "icd.h"
#include "json.h"
#include "log.h"

#define EXPORT __attribute__((visibility("default")))

static am_platform the_platform = {
    .handle = {.dispatch = &am_dispatch, .magic = AM_MAGIC_PLATFORM},
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .dying_done = PTHREAD_COND_INITIALIZER,
};

am_platform *am_platform_get(void) {
    return &the_platform;
}

/* seconds the process's exit waits for contexts the application released
 * and whose last internal reference has not gone yet (normally: none, or
 * milliseconds) */
#define EXIT_WAIT 2

static void wait_for_dying(void) {
    am_platform *p = &the_platform;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += EXIT_WAIT;
    pthread_mutex_lock(&p->mu);
    while (p->dying > 0 && pthread_cond_timedwait(&p->dying_done, &p->mu, &until) != ETIMEDOUT) {
    }
    if (p->dying > 0)
        am_info("%d released context(s) still held by objects at the process's exit: their sessions end "
                "at the pool's grace", p->dying);
    pthread_mutex_unlock(&p->mu);
}

void am_platform_context_made(void) {
    am_platform *p = &the_platform;
    pthread_mutex_lock(&p->mu);
    if (!p->exit_hook)
        p->exit_hook = atexit(wait_for_dying) == 0;
    pthread_mutex_unlock(&p->mu);
}

void am_platform_dying_begin(void) {
    am_platform *p = &the_platform;
    pthread_mutex_lock(&p->mu);
    p->dying++;
    pthread_mutex_unlock(&p->mu);
}

void am_platform_dying_end(void) {
    am_platform *p = &the_platform;
    pthread_mutex_lock(&p->mu);
    p->dying--;
    pthread_cond_broadcast(&p->dying_done);
    pthread_mutex_unlock(&p->mu);
}

static void configure_locked(am_platform *p) {
    if (p->configured)
        return;
    p->configured = true;
    p->config_ok = am_config_load(&p->config, &p->config_error) == 0;
    if (!p->config_ok) {
        am_error_log("%s", p->config_error.message);
        return;
    }
    if (p->config.insecure == 1) {
        am_warn("INSECURE: plain TCP to the pool at %s (ACCELMIG_INSECURE / insecure): anyone on the path reads "
                "the tenant token, the session secret and the data", p->config.endpoint);
        return;
    }
    p->tls = am_tls_context(p->config.cafile, &p->config_error);
    if (p->tls == NULL) {
        p->config_ok = false;
        am_error_log("%s", p->config_error.message);
    }
}

const am_config *am_platform_config(am_error *err) {
    am_platform *p = &the_platform;
    pthread_mutex_lock(&p->mu);
    configure_locked(p);
    bool ok = p->config_ok;
    if (!ok && err != NULL)
        *err = p->config_error;
    pthread_mutex_unlock(&p->mu);
    return ok ? &p->config : NULL;
}

SSL_CTX *am_platform_tls(void) {
    return the_platform.tls;
}

bool am_is_device(cl_device_id device) {
    return device != NULL && device->magic == AM_MAGIC_DEVICE;
}

static cl_device_type type_of(const char *name) {
    if (strcmp(name, "gpu") == 0)
        return CL_DEVICE_TYPE_GPU;
    if (strcmp(name, "accelerator") == 0)
        return CL_DEVICE_TYPE_ACCELERATOR;
    if (strcmp(name, "custom") == 0)
        return CL_DEVICE_TYPE_CUSTOM;
    return CL_DEVICE_TYPE_CPU;
}

/* The pool's devices, once; false (and a log line) while it cannot be reached. */
static bool discover_locked(am_platform *p) {
    if (p->discovered)
        return true;
    configure_locked(p);
    if (!p->config_ok)
        return false;
    am_error err = {0};
    enum am_log_level level = p->discovery_failed ? AM_LOG_INFO : AM_LOG_WARNING;
    if (am_config_ready(&p->config, &err) != 0) {
        am_log(level, "no devices: %s", err.message);
        p->discovery_failed = true;
        return false;
    }
    json_object *answer = am_list_devices(&p->config, p->tls, &err);
    if (answer == NULL) {
        am_log(level, "no devices: the pool at %s: %s: %s", p->config.endpoint, err.code, err.message);
        p->discovery_failed = true;
        return false;
    }
    json_object *devices = am_json_get(answer, "devices");
    size_t count = devices != NULL && json_object_is_type(devices, json_type_array)
                       ? json_object_array_length(devices) : 0;
    cl_uint made = 0;
    for (size_t i = 0; i < count && made < AM_MAX_DEVICES; i++) {
        json_object *entry = json_object_array_get_idx(devices, i);
        size_t id_len = 0;
        const char *id = am_json_str(entry, "id", &id_len);
        const char *type = am_json_str(entry, "type", NULL);
        if (id == NULL || id_len == 0 || id_len >= sizeof p->devices[0].id || !am_utf8_valid(id, id_len) ||
            strpbrk(id, "\"\\") != NULL || type == NULL) {
            am_warn("the pool listed a device without a usable id: left out");
            continue;
        }
        struct _cl_device_id *device = &p->devices[made];
        memset(device, 0, sizeof *device);
        device->dispatch = &am_dispatch;
        memcpy(device->id, id, id_len + 1);
        device->type = type_of(type);
        if (am_devparams_decode(&device->params, am_json_get(entry, "cl")) != 0) {
            am_warn("device %s: out of memory for its parameters", id);
            continue;
        }
        am_devparams_restrict(&device->params);
        uint64_t cl_type = am_devparams_uint(&device->params, CL_DEVICE_TYPE);
        if (cl_type != 0)
            device->type = cl_type;
        device->magic = AM_MAGIC_DEVICE;
        made++;
    }
    json_object_put(answer);
    p->num_devices = made;
    p->discovered = true;
    am_info("the pool at %s lists %u device(s)", p->config.endpoint, made);
    return true;
}

uint64_t am_device_uint(cl_device_id device, cl_device_info param) {
    return am_devparams_uint(&device->params, param);
}

/* -- info helpers ------------------------------------------------------------------------ */

cl_int am_answer(size_t size, void *value, size_t *size_ret, const void *data, size_t len) {
    if (value != NULL) {
        if (size < len)
            return CL_INVALID_VALUE;
        if (len && data != NULL)
            memcpy(value, data, len);
    }
    if (size_ret != NULL)
        *size_ret = len;
    return CL_SUCCESS;
}

cl_int am_answer_str(size_t size, void *value, size_t *size_ret, const char *text) {
    return am_answer(size, value, size_ret, text, strlen(text) + 1);
}

/* -- the ICD entry points ----------------------------------------------------------------- */

static cl_int get_platform_ids(cl_uint num_entries, cl_platform_id *platforms, cl_uint *num_platforms) {
    if ((platforms != NULL && num_entries == 0) || (platforms == NULL && num_platforms == NULL))
        return CL_INVALID_VALUE;
    if (platforms != NULL)
        platforms[0] = &the_platform.handle;
    if (num_platforms != NULL)
        *num_platforms = 1;
    return CL_SUCCESS;
}

EXPORT CL_API_ENTRY cl_int CL_API_CALL clIcdGetPlatformIDsKHR(cl_uint num_entries, cl_platform_id *platforms,
                                                                cl_uint *num_platforms) {
    return get_platform_ids(num_entries, platforms, num_platforms);
}

static cl_int CL_API_CALL am_clGetPlatformIDs(cl_uint num_entries, cl_platform_id *platforms,
                                              cl_uint *num_platforms) {
    return get_platform_ids(num_entries, platforms, num_platforms);
}

EXPORT CL_API_ENTRY void *CL_API_CALL clGetExtensionFunctionAddress(const char *name) {
    if (name != NULL && strcmp(name, "clIcdGetPlatformIDsKHR") == 0)
        return (void *)clIcdGetPlatformIDsKHR;
    return NULL; /* this driver adds no extension functions */
}

static void *CL_API_CALL am_clGetExtensionFunctionAddressForPlatform(cl_platform_id platform, const char *name) {
    if (platform != &the_platform.handle)
        return NULL;
    return clGetExtensionFunctionAddress(name);
}

static cl_int CL_API_CALL am_clGetPlatformInfo(cl_platform_id platform, cl_platform_info param, size_t size,
                                               void *value, size_t *size_ret) {
    if (platform != NULL && platform != &the_platform.handle)
        return CL_INVALID_PLATFORM;
    switch (param) {
    case CL_PLATFORM_PROFILE:
        return am_answer_str(size, value, size_ret, "FULL_PROFILE");
    case CL_PLATFORM_VERSION:
        return am_answer_str(size, value, size_ret, AM_PLATFORM_VERSION);
    case CL_PLATFORM_NAME:
        return am_answer_str(size, value, size_ret, AM_PLATFORM_NAME);
    case CL_PLATFORM_VENDOR:
        return am_answer_str(size, value, size_ret, AM_PLATFORM_VENDOR);
    case CL_PLATFORM_EXTENSIONS:
        return am_answer_str(size, value, size_ret, "cl_khr_icd");
    case CL_PLATFORM_ICD_SUFFIX_KHR:
        return am_answer_str(size, value, size_ret, AM_ICD_SUFFIX);
    case CL_PLATFORM_HOST_TIMER_RESOLUTION: {
        cl_ulong none = 0; /* no host timer: clGetHostTimer says CL_INVALID_OPERATION */
        return am_answer(size, value, size_ret, &none, sizeof none);
    }
    case CL_PLATFORM_NUMERIC_VERSION: {
        cl_version version = CL_MAKE_VERSION(3, 0, 0);
        return am_answer(size, value, size_ret, &version, sizeof version);
    }
    case CL_PLATFORM_EXTENSIONS_WITH_VERSION: {
        cl_name_version icd;
        memset(&icd, 0, sizeof icd);
        icd.version = CL_MAKE_VERSION(1, 0, 0);
        strcpy(icd.name, "cl_khr_icd");
        return am_answer(size, value, size_ret, &icd, sizeof icd);
    }
    default:
        return CL_INVALID_VALUE;
    }
}

/* The loader looks it up by name too (cl_khr_icd: with clIcdGetPlatformIDsKHR
 * and clGetExtensionFunctionAddress), to read the platform's ICD suffix. */
EXPORT CL_API_ENTRY cl_int CL_API_CALL clGetPlatformInfo(cl_platform_id platform, cl_platform_info param,
                                                           size_t size, void *value, size_t *size_ret) {
    return am_clGetPlatformInfo(platform, param, size, value, size_ret);
}

/* (the loader passes a NULL platform through as ours) */
static cl_int CL_API_CALL am_clGetDeviceIDs(cl_platform_id platform, cl_device_type type, cl_uint num_entries,
                                            cl_device_id *devices, cl_uint *num_devices) {
    am_platform *p = &the_platform;
    if (platform != NULL && platform != &p->handle)
        return CL_INVALID_PLATFORM;
    const cl_device_type known = CL_DEVICE_TYPE_DEFAULT | CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU |
                                 CL_DEVICE_TYPE_ACCELERATOR | CL_DEVICE_TYPE_CUSTOM;
    if (type != CL_DEVICE_TYPE_ALL && (type & ~known) != 0)
        return CL_INVALID_DEVICE_TYPE;
    if ((devices != NULL && num_entries == 0) || (devices == NULL && num_devices == NULL))
        return CL_INVALID_VALUE;
    pthread_mutex_lock(&p->mu);
    discover_locked(p);
    cl_uint found = 0;
    for (cl_uint i = 0; i < p->num_devices; i++) {
        struct _cl_device_id *device = &p->devices[i];
        /* the first device is the default one */
        bool wanted = type == CL_DEVICE_TYPE_ALL || (device->type & type) != 0 ||
                      ((type & CL_DEVICE_TYPE_DEFAULT) && i == 0);
        if (!wanted)
            continue;
        if (devices != NULL && found < num_entries)
            devices[found] = device;
        found++;
    }
    pthread_mutex_unlock(&p->mu);
    if (num_devices != NULL)
        *num_devices = found;
    return found ? CL_SUCCESS : CL_DEVICE_NOT_FOUND;
}

static cl_int CL_API_CALL am_clGetDeviceInfo(cl_device_id device, cl_device_info param, size_t size, void *value,
                                             size_t *size_ret) {
    if (!am_is_device(device))
        return CL_INVALID_DEVICE;
    switch (param) {
    case CL_DEVICE_PLATFORM: {
        cl_platform_id platform = &the_platform.handle;
        return am_answer(size, value, size_ret, &platform, sizeof platform);
    }
    case CL_DEVICE_PARENT_DEVICE: {
        cl_device_id none = NULL;
        return am_answer(size, value, size_ret, &none, sizeof none);
    }
    case CL_DEVICE_REFERENCE_COUNT: {
        cl_uint one = 1; /* a root device */
        return am_answer(size, value, size_ret, &one, sizeof one);
    }
    case CL_DEVICE_PARTITION_TYPE:
        return am_answer(size, value, size_ret, NULL, 0); /* not a sub-device */
    default: {
        const am_param_value *known = am_devparams_get(&device->params, param);
        if (known == NULL)
            return CL_INVALID_VALUE;
        return am_answer(size, value, size_ret, known->bytes, known->len);
    }
    }
}

static cl_int CL_API_CALL am_clCreateSubDevices(cl_device_id device, const cl_device_partition_property *props,
                                                cl_uint num, cl_device_id *out, cl_uint *num_ret) {
    (void)props, (void)num, (void)out, (void)num_ret;
    if (!am_is_device(device))
        return CL_INVALID_DEVICE;
    return CL_INVALID_VALUE; /* CL_DEVICE_PARTITION_PROPERTIES lists none */
}

static cl_int CL_API_CALL am_clRetainDevice(cl_device_id device) {
    return am_is_device(device) ? CL_SUCCESS : CL_INVALID_DEVICE; /* root devices: nothing to count */
}

static cl_int CL_API_CALL am_clReleaseDevice(cl_device_id device) {
    return am_is_device(device) ? CL_SUCCESS : CL_INVALID_DEVICE;
}

static cl_int CL_API_CALL am_clUnloadCompiler(void) {
    return CL_SUCCESS;
}

static cl_int CL_API_CALL am_clUnloadPlatformCompiler(cl_platform_id platform) {
    return platform == &the_platform.handle ? CL_SUCCESS : CL_INVALID_PLATFORM;
}

static cl_int CL_API_CALL am_clGetHostTimer(cl_device_id device, cl_ulong *host) {
    (void)host;
    return am_is_device(device) ? CL_INVALID_OPERATION : CL_INVALID_DEVICE;
}

static cl_int CL_API_CALL am_clGetDeviceAndHostTimer(cl_device_id device, cl_ulong *dev, cl_ulong *host) {
    (void)dev, (void)host;
    return am_is_device(device) ? CL_INVALID_OPERATION : CL_INVALID_DEVICE;
}

/* the dispatch table's share of this file (dispatch.c gathers them) */
void am_platform_functions(cl_icd_dispatch *d);
void am_platform_functions(cl_icd_dispatch *d) {
    d->clGetPlatformIDs = am_clGetPlatformIDs;
    d->clGetPlatformInfo = am_clGetPlatformInfo;
    d->clGetDeviceIDs = am_clGetDeviceIDs;
    d->clGetDeviceInfo = am_clGetDeviceInfo;
    d->clCreateSubDevices = am_clCreateSubDevices;
    d->clRetainDevice = am_clRetainDevice;
    d->clReleaseDevice = am_clReleaseDevice;
    d->clUnloadCompiler = am_clUnloadCompiler;
    d->clUnloadPlatformCompiler = am_clUnloadPlatformCompiler;
    d->clGetExtensionFunctionAddress = clGetExtensionFunctionAddress;
    d->clGetExtensionFunctionAddressForPlatform = am_clGetExtensionFunctionAddressForPlatform;
    d->clGetHostTimer = am_clGetHostTimer;
    d->clGetDeviceAndHostTimer = am_clGetDeviceAndHostTimer;
}

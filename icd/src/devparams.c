#include "devparams.h"

#include <CL/cl_ext.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"
#include "json.h"

#define MAX_TEXT (16 * 1024)
#define MAX_LIST 256

const am_param_spec AM_DEVICE_PARAMS[] = {
    {"CL_DEVICE_TYPE", CL_DEVICE_TYPE, AM_KIND_ULONG},
    {"CL_DEVICE_VENDOR_ID", CL_DEVICE_VENDOR_ID, AM_KIND_UINT},
    {"CL_DEVICE_MAX_COMPUTE_UNITS", CL_DEVICE_MAX_COMPUTE_UNITS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS", CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_WORK_GROUP_SIZE", CL_DEVICE_MAX_WORK_GROUP_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_MAX_WORK_ITEM_SIZES", CL_DEVICE_MAX_WORK_ITEM_SIZES, AM_KIND_SIZES},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_CHAR", CL_DEVICE_PREFERRED_VECTOR_WIDTH_CHAR, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_SHORT", CL_DEVICE_PREFERRED_VECTOR_WIDTH_SHORT, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_INT", CL_DEVICE_PREFERRED_VECTOR_WIDTH_INT, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_LONG", CL_DEVICE_PREFERRED_VECTOR_WIDTH_LONG, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT", CL_DEVICE_PREFERRED_VECTOR_WIDTH_FLOAT, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_DOUBLE", CL_DEVICE_PREFERRED_VECTOR_WIDTH_DOUBLE, AM_KIND_UINT},
    {"CL_DEVICE_MAX_CLOCK_FREQUENCY", CL_DEVICE_MAX_CLOCK_FREQUENCY, AM_KIND_UINT},
    {"CL_DEVICE_ADDRESS_BITS", CL_DEVICE_ADDRESS_BITS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_READ_IMAGE_ARGS", CL_DEVICE_MAX_READ_IMAGE_ARGS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_WRITE_IMAGE_ARGS", CL_DEVICE_MAX_WRITE_IMAGE_ARGS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_MEM_ALLOC_SIZE", CL_DEVICE_MAX_MEM_ALLOC_SIZE, AM_KIND_ULONG},
    {"CL_DEVICE_IMAGE2D_MAX_WIDTH", CL_DEVICE_IMAGE2D_MAX_WIDTH, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE2D_MAX_HEIGHT", CL_DEVICE_IMAGE2D_MAX_HEIGHT, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE3D_MAX_WIDTH", CL_DEVICE_IMAGE3D_MAX_WIDTH, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE3D_MAX_HEIGHT", CL_DEVICE_IMAGE3D_MAX_HEIGHT, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE3D_MAX_DEPTH", CL_DEVICE_IMAGE3D_MAX_DEPTH, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE_SUPPORT", CL_DEVICE_IMAGE_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_MAX_PARAMETER_SIZE", CL_DEVICE_MAX_PARAMETER_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_MAX_SAMPLERS", CL_DEVICE_MAX_SAMPLERS, AM_KIND_UINT},
    {"CL_DEVICE_MEM_BASE_ADDR_ALIGN", CL_DEVICE_MEM_BASE_ADDR_ALIGN, AM_KIND_UINT},
    {"CL_DEVICE_MIN_DATA_TYPE_ALIGN_SIZE", CL_DEVICE_MIN_DATA_TYPE_ALIGN_SIZE, AM_KIND_UINT},
    {"CL_DEVICE_SINGLE_FP_CONFIG", CL_DEVICE_SINGLE_FP_CONFIG, AM_KIND_ULONG},
    {"CL_DEVICE_GLOBAL_MEM_CACHE_TYPE", CL_DEVICE_GLOBAL_MEM_CACHE_TYPE, AM_KIND_UINT},
    {"CL_DEVICE_GLOBAL_MEM_CACHELINE_SIZE", CL_DEVICE_GLOBAL_MEM_CACHELINE_SIZE, AM_KIND_UINT},
    {"CL_DEVICE_GLOBAL_MEM_CACHE_SIZE", CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, AM_KIND_ULONG},
    {"CL_DEVICE_GLOBAL_MEM_SIZE", CL_DEVICE_GLOBAL_MEM_SIZE, AM_KIND_ULONG},
    {"CL_DEVICE_MAX_CONSTANT_BUFFER_SIZE", CL_DEVICE_MAX_CONSTANT_BUFFER_SIZE, AM_KIND_ULONG},
    {"CL_DEVICE_MAX_CONSTANT_ARGS", CL_DEVICE_MAX_CONSTANT_ARGS, AM_KIND_UINT},
    {"CL_DEVICE_LOCAL_MEM_TYPE", CL_DEVICE_LOCAL_MEM_TYPE, AM_KIND_UINT},
    {"CL_DEVICE_LOCAL_MEM_SIZE", CL_DEVICE_LOCAL_MEM_SIZE, AM_KIND_ULONG},
    {"CL_DEVICE_ERROR_CORRECTION_SUPPORT", CL_DEVICE_ERROR_CORRECTION_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_PROFILING_TIMER_RESOLUTION", CL_DEVICE_PROFILING_TIMER_RESOLUTION, AM_KIND_SIZE},
    {"CL_DEVICE_ENDIAN_LITTLE", CL_DEVICE_ENDIAN_LITTLE, AM_KIND_BOOL},
    {"CL_DEVICE_AVAILABLE", CL_DEVICE_AVAILABLE, AM_KIND_BOOL},
    {"CL_DEVICE_COMPILER_AVAILABLE", CL_DEVICE_COMPILER_AVAILABLE, AM_KIND_BOOL},
    {"CL_DEVICE_EXECUTION_CAPABILITIES", CL_DEVICE_EXECUTION_CAPABILITIES, AM_KIND_ULONG},
    {"CL_DEVICE_QUEUE_ON_HOST_PROPERTIES", CL_DEVICE_QUEUE_ON_HOST_PROPERTIES, AM_KIND_ULONG},
    {"CL_DEVICE_NAME", CL_DEVICE_NAME, AM_KIND_STR},
    {"CL_DEVICE_VENDOR", CL_DEVICE_VENDOR, AM_KIND_STR},
    {"CL_DRIVER_VERSION", CL_DRIVER_VERSION, AM_KIND_STR},
    {"CL_DEVICE_PROFILE", CL_DEVICE_PROFILE, AM_KIND_STR},
    {"CL_DEVICE_VERSION", CL_DEVICE_VERSION, AM_KIND_STR},
    {"CL_DEVICE_EXTENSIONS", CL_DEVICE_EXTENSIONS, AM_KIND_STR},
    {"CL_DEVICE_DOUBLE_FP_CONFIG", CL_DEVICE_DOUBLE_FP_CONFIG, AM_KIND_ULONG},
    {"CL_DEVICE_HALF_FP_CONFIG", CL_DEVICE_HALF_FP_CONFIG, AM_KIND_ULONG},
    {"CL_DEVICE_PREFERRED_VECTOR_WIDTH_HALF", CL_DEVICE_PREFERRED_VECTOR_WIDTH_HALF, AM_KIND_UINT},
    {"CL_DEVICE_HOST_UNIFIED_MEMORY", CL_DEVICE_HOST_UNIFIED_MEMORY, AM_KIND_BOOL},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_CHAR", CL_DEVICE_NATIVE_VECTOR_WIDTH_CHAR, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_SHORT", CL_DEVICE_NATIVE_VECTOR_WIDTH_SHORT, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_INT", CL_DEVICE_NATIVE_VECTOR_WIDTH_INT, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_LONG", CL_DEVICE_NATIVE_VECTOR_WIDTH_LONG, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT", CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_DOUBLE", CL_DEVICE_NATIVE_VECTOR_WIDTH_DOUBLE, AM_KIND_UINT},
    {"CL_DEVICE_NATIVE_VECTOR_WIDTH_HALF", CL_DEVICE_NATIVE_VECTOR_WIDTH_HALF, AM_KIND_UINT},
    {"CL_DEVICE_OPENCL_C_VERSION", CL_DEVICE_OPENCL_C_VERSION, AM_KIND_STR},
    {"CL_DEVICE_LINKER_AVAILABLE", CL_DEVICE_LINKER_AVAILABLE, AM_KIND_BOOL},
    {"CL_DEVICE_BUILT_IN_KERNELS", CL_DEVICE_BUILT_IN_KERNELS, AM_KIND_STR},
    {"CL_DEVICE_IMAGE_MAX_BUFFER_SIZE", CL_DEVICE_IMAGE_MAX_BUFFER_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE_MAX_ARRAY_SIZE", CL_DEVICE_IMAGE_MAX_ARRAY_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_PARTITION_MAX_SUB_DEVICES", CL_DEVICE_PARTITION_MAX_SUB_DEVICES, AM_KIND_UINT},
    {"CL_DEVICE_PARTITION_PROPERTIES", CL_DEVICE_PARTITION_PROPERTIES, AM_KIND_PROPS},
    {"CL_DEVICE_PARTITION_AFFINITY_DOMAIN", CL_DEVICE_PARTITION_AFFINITY_DOMAIN, AM_KIND_ULONG},
    {"CL_DEVICE_PREFERRED_INTEROP_USER_SYNC", CL_DEVICE_PREFERRED_INTEROP_USER_SYNC, AM_KIND_BOOL},
    {"CL_DEVICE_PRINTF_BUFFER_SIZE", CL_DEVICE_PRINTF_BUFFER_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_IMAGE_PITCH_ALIGNMENT", CL_DEVICE_IMAGE_PITCH_ALIGNMENT, AM_KIND_UINT},
    {"CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT", CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT, AM_KIND_UINT},
    {"CL_DEVICE_MAX_READ_WRITE_IMAGE_ARGS", CL_DEVICE_MAX_READ_WRITE_IMAGE_ARGS, AM_KIND_UINT},
    {"CL_DEVICE_MAX_GLOBAL_VARIABLE_SIZE", CL_DEVICE_MAX_GLOBAL_VARIABLE_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_QUEUE_ON_DEVICE_PROPERTIES", CL_DEVICE_QUEUE_ON_DEVICE_PROPERTIES, AM_KIND_ULONG},
    {"CL_DEVICE_QUEUE_ON_DEVICE_PREFERRED_SIZE", CL_DEVICE_QUEUE_ON_DEVICE_PREFERRED_SIZE, AM_KIND_UINT},
    {"CL_DEVICE_QUEUE_ON_DEVICE_MAX_SIZE", CL_DEVICE_QUEUE_ON_DEVICE_MAX_SIZE, AM_KIND_UINT},
    {"CL_DEVICE_MAX_ON_DEVICE_QUEUES", CL_DEVICE_MAX_ON_DEVICE_QUEUES, AM_KIND_UINT},
    {"CL_DEVICE_MAX_ON_DEVICE_EVENTS", CL_DEVICE_MAX_ON_DEVICE_EVENTS, AM_KIND_UINT},
    {"CL_DEVICE_SVM_CAPABILITIES", CL_DEVICE_SVM_CAPABILITIES, AM_KIND_ULONG},
    {"CL_DEVICE_GLOBAL_VARIABLE_PREFERRED_TOTAL_SIZE", CL_DEVICE_GLOBAL_VARIABLE_PREFERRED_TOTAL_SIZE, AM_KIND_SIZE},
    {"CL_DEVICE_MAX_PIPE_ARGS", CL_DEVICE_MAX_PIPE_ARGS, AM_KIND_UINT},
    {"CL_DEVICE_PIPE_MAX_ACTIVE_RESERVATIONS", CL_DEVICE_PIPE_MAX_ACTIVE_RESERVATIONS, AM_KIND_UINT},
    {"CL_DEVICE_PIPE_MAX_PACKET_SIZE", CL_DEVICE_PIPE_MAX_PACKET_SIZE, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_PLATFORM_ATOMIC_ALIGNMENT", CL_DEVICE_PREFERRED_PLATFORM_ATOMIC_ALIGNMENT, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_GLOBAL_ATOMIC_ALIGNMENT", CL_DEVICE_PREFERRED_GLOBAL_ATOMIC_ALIGNMENT, AM_KIND_UINT},
    {"CL_DEVICE_PREFERRED_LOCAL_ATOMIC_ALIGNMENT", CL_DEVICE_PREFERRED_LOCAL_ATOMIC_ALIGNMENT, AM_KIND_UINT},
    {"CL_DEVICE_IL_VERSION", CL_DEVICE_IL_VERSION, AM_KIND_STR},
    {"CL_DEVICE_MAX_NUM_SUB_GROUPS", CL_DEVICE_MAX_NUM_SUB_GROUPS, AM_KIND_UINT},
    {"CL_DEVICE_SUB_GROUP_INDEPENDENT_FORWARD_PROGRESS", CL_DEVICE_SUB_GROUP_INDEPENDENT_FORWARD_PROGRESS, AM_KIND_BOOL},
    {"CL_DEVICE_NUMERIC_VERSION", CL_DEVICE_NUMERIC_VERSION, AM_KIND_UINT},
    {"CL_DEVICE_EXTENSIONS_WITH_VERSION", CL_DEVICE_EXTENSIONS_WITH_VERSION, AM_KIND_VERSIONS},
    {"CL_DEVICE_ILS_WITH_VERSION", CL_DEVICE_ILS_WITH_VERSION, AM_KIND_VERSIONS},
    {"CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION", CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION, AM_KIND_VERSIONS},
    {"CL_DEVICE_ATOMIC_MEMORY_CAPABILITIES", CL_DEVICE_ATOMIC_MEMORY_CAPABILITIES, AM_KIND_ULONG},
    {"CL_DEVICE_ATOMIC_FENCE_CAPABILITIES", CL_DEVICE_ATOMIC_FENCE_CAPABILITIES, AM_KIND_ULONG},
    {"CL_DEVICE_NON_UNIFORM_WORK_GROUP_SUPPORT", CL_DEVICE_NON_UNIFORM_WORK_GROUP_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_OPENCL_C_ALL_VERSIONS", CL_DEVICE_OPENCL_C_ALL_VERSIONS, AM_KIND_VERSIONS},
    {"CL_DEVICE_PREFERRED_WORK_GROUP_SIZE_MULTIPLE", CL_DEVICE_PREFERRED_WORK_GROUP_SIZE_MULTIPLE, AM_KIND_SIZE},
    {"CL_DEVICE_WORK_GROUP_COLLECTIVE_FUNCTIONS_SUPPORT", CL_DEVICE_WORK_GROUP_COLLECTIVE_FUNCTIONS_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_GENERIC_ADDRESS_SPACE_SUPPORT", CL_DEVICE_GENERIC_ADDRESS_SPACE_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_OPENCL_C_FEATURES", CL_DEVICE_OPENCL_C_FEATURES, AM_KIND_VERSIONS},
    {"CL_DEVICE_DEVICE_ENQUEUE_CAPABILITIES", CL_DEVICE_DEVICE_ENQUEUE_CAPABILITIES, AM_KIND_ULONG},
    {"CL_DEVICE_PIPE_SUPPORT", CL_DEVICE_PIPE_SUPPORT, AM_KIND_BOOL},
    {"CL_DEVICE_LATEST_CONFORMANCE_VERSION_PASSED", CL_DEVICE_LATEST_CONFORMANCE_VERSION_PASSED, AM_KIND_STR},
};
const size_t AM_DEVICE_PARAM_COUNT = sizeof AM_DEVICE_PARAMS / sizeof *AM_DEVICE_PARAMS;

const char *am_param_kind_name(am_param_kind kind) {
    static const char *const names[] = {"uint", "bool", "ulong", "size", "str", "sizes", "props", "versions"};
    return (size_t)kind < sizeof names / sizeof *names ? names[kind] : "?";
}

static int put(am_devparams *params, cl_device_info code, const void *bytes, size_t len) {
    for (size_t i = 0; i < params->count; i++)
        if (params->values[i].code == code) {
            uint8_t *copy = malloc(len ? len : 1);
            if (copy == NULL)
                return -1;
            if (len)
                memcpy(copy, bytes, len);
            free(params->values[i].bytes);
            params->values[i].bytes = copy;
            params->values[i].len = len;
            return 0;
        }
    am_param_value *more = realloc(params->values, (params->count + 1) * sizeof *more);
    if (more == NULL)
        return -1;
    params->values = more;
    uint8_t *copy = malloc(len ? len : 1);
    if (copy == NULL)
        return -1;
    if (len)
        memcpy(copy, bytes, len);
    params->values[params->count++] = (am_param_value){code, copy, len};
    return 0;
}

/* One value as its kind's bytes into `out` (0), or -1 when it does not fit. */
static int encode(am_param_kind kind, json_object *value, am_buf *out) {
    uint64_t u;
    switch (kind) {
    case AM_KIND_UINT: {
        if (!am_json_u64_max(value, UINT32_MAX, &u))
            return -1;
        cl_uint v = (cl_uint)u;
        return am_buf_append(out, &v, sizeof v);
    }
    case AM_KIND_BOOL: {
        bool b;
        if (!am_json_bool(value, &b))
            return -1;
        cl_bool v = b ? CL_TRUE : CL_FALSE;
        return am_buf_append(out, &v, sizeof v);
    }
    case AM_KIND_ULONG: {
        if (!am_json_u64(value, &u))
            return -1;
        cl_ulong v = u;
        return am_buf_append(out, &v, sizeof v);
    }
    case AM_KIND_SIZE: {
        if (!am_json_u64_max(value, SIZE_MAX, &u))
            return -1;
        size_t v = (size_t)u;
        return am_buf_append(out, &v, sizeof v);
    }
    case AM_KIND_STR: {
        if (!json_object_is_type(value, json_type_string))
            return -1;
        size_t len = (size_t)json_object_get_string_len(value);
        const char *text = json_object_get_string(value);
        if (len > MAX_TEXT || memchr(text, 0, len) != NULL)
            return -1;
        return am_buf_append(out, text, len + 1);
    }
    case AM_KIND_SIZES:
    case AM_KIND_PROPS: {
        if (!json_object_is_type(value, json_type_array) || json_object_array_length(value) > MAX_LIST)
            return -1;
        for (size_t i = 0; i < json_object_array_length(value); i++) {
            json_object *item = json_object_array_get_idx(value, i);
            if (kind == AM_KIND_SIZES) {
                if (!am_json_u64_max(item, SIZE_MAX, &u))
                    return -1;
                size_t v = (size_t)u;
                if (am_buf_append(out, &v, sizeof v) != 0)
                    return -1;
            } else {
                int64_t s;
                if (!am_json_i64(item, &s))
                    return -1;
                cl_device_partition_property v = (cl_device_partition_property)s;
                if (am_buf_append(out, &v, sizeof v) != 0)
                    return -1;
            }
        }
        return 0;
    }
    case AM_KIND_VERSIONS: {
        if (!json_object_is_type(value, json_type_array) || json_object_array_length(value) > MAX_LIST)
            return -1;
        for (size_t i = 0; i < json_object_array_length(value); i++) {
            json_object *pair = json_object_array_get_idx(value, i);
            if (!json_object_is_type(pair, json_type_array) || json_object_array_length(pair) != 2)
                return -1;
            json_object *name = json_object_array_get_idx(pair, 1);
            if (!am_json_u64_max(json_object_array_get_idx(pair, 0), UINT32_MAX, &u) ||
                !json_object_is_type(name, json_type_string) ||
                (size_t)json_object_get_string_len(name) >= CL_NAME_VERSION_MAX_NAME_SIZE ||
                memchr(json_object_get_string(name), 0, (size_t)json_object_get_string_len(name)) != NULL)
                return -1;
            cl_name_version v;
            memset(&v, 0, sizeof v);
            v.version = (cl_version)u;
            memcpy(v.name, json_object_get_string(name), (size_t)json_object_get_string_len(name));
            if (am_buf_append(out, &v, sizeof v) != 0)
                return -1;
        }
        return 0;
    }
    }
    return -1;
}

int am_devparams_decode(am_devparams *params, json_object *cl) {
    memset(params, 0, sizeof *params);
    if (cl == NULL || !json_object_is_type(cl, json_type_object))
        return 0;
    for (size_t i = 0; i < AM_DEVICE_PARAM_COUNT; i++) {
        json_object *value = am_json_get(cl, AM_DEVICE_PARAMS[i].name);
        if (value == NULL)
            continue;
        am_buf bytes;
        am_buf_init(&bytes);
        if (encode(AM_DEVICE_PARAMS[i].kind, value, &bytes) == 0 &&
            put(params, AM_DEVICE_PARAMS[i].code, bytes.data, bytes.len) != 0) {
            am_buf_free(&bytes);
            am_devparams_free(params);
            return -1;
        }
        am_buf_free(&bytes);
    }
    return 0;
}

const am_param_value *am_devparams_get(const am_devparams *params, cl_device_info code) {
    for (size_t i = 0; i < params->count; i++)
        if (params->values[i].code == code)
            return &params->values[i];
    return NULL;
}

void am_devparams_free(am_devparams *params) {
    for (size_t i = 0; i < params->count; i++)
        free(params->values[i].bytes);
    free(params->values);
    memset(params, 0, sizeof *params);
}

uint64_t am_devparams_uint(const am_devparams *params, cl_device_info code) {
    const am_param_value *value = am_devparams_get(params, code);
    if (value == NULL)
        return 0;
    if (value->len == 4) {
        cl_uint v;
        memcpy(&v, value->bytes, 4);
        return v;
    }
    if (value->len == 8) {
        cl_ulong v;
        memcpy(&v, value->bytes, 8);
        return v;
    }
    return 0;
}

const char *am_devparams_str(const am_devparams *params, cl_device_info code) {
    const am_param_value *value = am_devparams_get(params, code);
    return value != NULL && value->len > 0 && value->bytes[value->len - 1] == 0 ? (const char *)value->bytes : "";
}

/* -- what this driver offers of the device ---------------------------------------- */

/* Extensions that are the device compiler's alone: nothing of them is
 * asked of the host API, so they work through this driver as they are. */
static const char *const DEVICE_SIDE_EXTENSIONS[] = {
    "cl_khr_byte_addressable_store", "cl_khr_global_int32_base_atomics", "cl_khr_global_int32_extended_atomics",
    "cl_khr_local_int32_base_atomics", "cl_khr_local_int32_extended_atomics", "cl_khr_int64_base_atomics",
    "cl_khr_int64_extended_atomics", "cl_khr_fp64", "cl_khr_fp16", "cl_khr_select_fprounding_mode",
    "cl_khr_extended_bit_ops", "cl_khr_expect_assume", "cl_khr_extended_async_copies",
};
/* OpenCL C features that need what this driver does not offer */
static const char *const HOST_BACKED_FEATURES[] = {
    "__opencl_c_images", "__opencl_c_3d_image_writes", "__opencl_c_read_write_images", "__opencl_c_pipes",
    "__opencl_c_device_enqueue",
};

static bool listed(const char *name, size_t len, const char *const *list, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (strlen(list[i]) == len && memcmp(list[i], name, len) == 0)
            return true;
    return false;
}

static void set_uint(am_devparams *p, cl_device_info code, cl_uint v) {
    if (am_devparams_get(p, code) != NULL)
        put(p, code, &v, sizeof v);
}

static void set_ulong(am_devparams *p, cl_device_info code, cl_ulong v) {
    if (am_devparams_get(p, code) != NULL)
        put(p, code, &v, sizeof v);
}

static void set_size(am_devparams *p, cl_device_info code, size_t v) {
    if (am_devparams_get(p, code) != NULL)
        put(p, code, &v, sizeof v);
}

static void restrict_extensions(am_devparams *p) {
    const char *all = am_devparams_str(p, CL_DEVICE_EXTENSIONS);
    am_buf kept;
    am_buf_init(&kept);
    for (const char *word = all; *word;) {
        size_t len = strcspn(word, " ");
        if (len && listed(word, len, DEVICE_SIDE_EXTENSIONS, sizeof DEVICE_SIDE_EXTENSIONS / sizeof *DEVICE_SIDE_EXTENSIONS)) {
            if (kept.len)
                am_buf_append(&kept, " ", 1);
            am_buf_append(&kept, word, len);
        }
        word += len;
        while (*word == ' ')
            word++;
    }
    if (am_devparams_get(p, CL_DEVICE_EXTENSIONS) != NULL)
        put(p, CL_DEVICE_EXTENSIONS, kept.len ? (const char *)kept.data : "", kept.len + 1);
    am_buf_free(&kept);
}

static void restrict_versions(am_devparams *p, cl_device_info code, const char *const *list, size_t count,
                              bool keep_listed) {
    const am_param_value *value = am_devparams_get(p, code);
    if (value == NULL)
        return;
    size_t n = value->len / sizeof(cl_name_version);
    cl_name_version *all = malloc(value->len ? value->len : 1);
    if (all == NULL)
        return;
    if (n)
        memcpy(all, value->bytes, n * sizeof *all);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = strnlen(all[i].name, CL_NAME_VERSION_MAX_NAME_SIZE);
        if (listed(all[i].name, len, list, count) == keep_listed)
            all[kept++] = all[i];
    }
    put(p, code, all, kept * sizeof *all);
    free(all);
}

void am_devparams_restrict(am_devparams *p) {
    /* images: not offered (OpenCL's way: image support false, every image limit 0) */
    set_uint(p, CL_DEVICE_IMAGE_SUPPORT, CL_FALSE);
    static const cl_device_info image_uints[] = {
        CL_DEVICE_MAX_READ_IMAGE_ARGS, CL_DEVICE_MAX_WRITE_IMAGE_ARGS, CL_DEVICE_MAX_READ_WRITE_IMAGE_ARGS,
        CL_DEVICE_MAX_SAMPLERS, CL_DEVICE_IMAGE_PITCH_ALIGNMENT, CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT};
    for (size_t i = 0; i < sizeof image_uints / sizeof *image_uints; i++)
        set_uint(p, image_uints[i], 0);
    static const cl_device_info image_sizes[] = {
        CL_DEVICE_IMAGE2D_MAX_WIDTH, CL_DEVICE_IMAGE2D_MAX_HEIGHT, CL_DEVICE_IMAGE3D_MAX_WIDTH,
        CL_DEVICE_IMAGE3D_MAX_HEIGHT, CL_DEVICE_IMAGE3D_MAX_DEPTH, CL_DEVICE_IMAGE_MAX_BUFFER_SIZE,
        CL_DEVICE_IMAGE_MAX_ARRAY_SIZE};
    for (size_t i = 0; i < sizeof image_sizes / sizeof *image_sizes; i++)
        set_size(p, image_sizes[i], 0);
    /* shared virtual memory, pipes, device-side enqueue: none */
    set_ulong(p, CL_DEVICE_SVM_CAPABILITIES, 0);
    set_uint(p, CL_DEVICE_PIPE_SUPPORT, CL_FALSE);
    set_uint(p, CL_DEVICE_MAX_PIPE_ARGS, 0);
    set_uint(p, CL_DEVICE_PIPE_MAX_ACTIVE_RESERVATIONS, 0);
    set_uint(p, CL_DEVICE_PIPE_MAX_PACKET_SIZE, 0);
    set_ulong(p, CL_DEVICE_DEVICE_ENQUEUE_CAPABILITIES, 0);
    set_ulong(p, CL_DEVICE_QUEUE_ON_DEVICE_PROPERTIES, 0);
    set_uint(p, CL_DEVICE_QUEUE_ON_DEVICE_PREFERRED_SIZE, 0);
    set_uint(p, CL_DEVICE_QUEUE_ON_DEVICE_MAX_SIZE, 0);
    set_uint(p, CL_DEVICE_MAX_ON_DEVICE_QUEUES, 0);
    set_uint(p, CL_DEVICE_MAX_ON_DEVICE_EVENTS, 0);
    /* the device is on the other side of a network, not in host memory */
    set_uint(p, CL_DEVICE_HOST_UNIFIED_MEMORY, CL_FALSE);
    /* no sub-devices (clCreateSubDevices says CL_INVALID_VALUE) */
    set_uint(p, CL_DEVICE_PARTITION_MAX_SUB_DEVICES, 0);
    set_ulong(p, CL_DEVICE_PARTITION_AFFINITY_DOMAIN, 0);
    if (am_devparams_get(p, CL_DEVICE_PARTITION_PROPERTIES) != NULL) {
        cl_device_partition_property none = 0;
        put(p, CL_DEVICE_PARTITION_PROPERTIES, &none, sizeof none);
    }
    /* kernels from source and device binaries only: no native, no built-in ones, no IL */
    set_ulong(p, CL_DEVICE_EXECUTION_CAPABILITIES, CL_EXEC_KERNEL);
    if (am_devparams_get(p, CL_DEVICE_BUILT_IN_KERNELS) != NULL)
        put(p, CL_DEVICE_BUILT_IN_KERNELS, "", 1);
    if (am_devparams_get(p, CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION) != NULL)
        put(p, CL_DEVICE_BUILT_IN_KERNELS_WITH_VERSION, "", 0);
    if (am_devparams_get(p, CL_DEVICE_IL_VERSION) != NULL)
        put(p, CL_DEVICE_IL_VERSION, "", 1);
    if (am_devparams_get(p, CL_DEVICE_ILS_WITH_VERSION) != NULL)
        put(p, CL_DEVICE_ILS_WITH_VERSION, "", 0);
    restrict_extensions(p);
    restrict_versions(p, CL_DEVICE_EXTENSIONS_WITH_VERSION, DEVICE_SIDE_EXTENSIONS,
                      sizeof DEVICE_SIDE_EXTENSIONS / sizeof *DEVICE_SIDE_EXTENSIONS, true);
    restrict_versions(p, CL_DEVICE_OPENCL_C_FEATURES, HOST_BACKED_FEATURES,
                      sizeof HOST_BACKED_FEATURES / sizeof *HOST_BACKED_FEATURES, false);
}

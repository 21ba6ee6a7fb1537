/* libFuzzer: a device listing's header (the pool's answer to
 * list_devices), parsed and every device's parameters decoded and
 * restricted as the driver does at discovery. */
#include <stddef.h>
#include <stdint.h>

#include "devparams.h"
#include "json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char why[128];
    json_object *answer = am_json_parse_header((const char *)data, size, why, sizeof why);
    if (answer == NULL)
        return 0;
    json_object *devices = am_json_get(answer, "devices");
    size_t count = devices != NULL && json_object_is_type(devices, json_type_array)
                       ? json_object_array_length(devices) : 0;
    for (size_t i = 0; i < count; i++) {
        am_devparams params;
        if (am_devparams_decode(&params, am_json_get(json_object_array_get_idx(devices, i), "cl")) != 0)
            continue;
        am_devparams_restrict(&params);
        (void)am_devparams_str(&params, CL_DEVICE_EXTENSIONS);
        (void)am_devparams_uint(&params, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
        am_devparams_free(&params);
    }
    json_object_put(answer);
    return 0;
}

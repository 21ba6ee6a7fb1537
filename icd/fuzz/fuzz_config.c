/* libFuzzer: the driver's configuration file (a TOML subset). */
#include <stddef.h>
#include <stdint.h>

#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    am_config cfg;
    am_error err;
    am_config_defaults(&cfg);
    (void)am_config_parse(&cfg, (const char *)data, size, "fuzz", &err);
    return 0;
}

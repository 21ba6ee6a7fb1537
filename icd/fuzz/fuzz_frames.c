/* libFuzzer: what a pool (or anyone in its place) may send, fed to a
 * session's frame reader and dispatch as its I/O thread would, in the
 * chunk sizes the first byte picks.  Nothing may crash, leak or be
 * undefined; a malformed stream must end with an error. */
#include <stddef.h>
#include <stdint.h>

#include "session.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    size_t chunk = (size_t)data[0] * 7 + 1;
    data++, size--;
    am_session *s = am_session_offline(8);
    if (s == NULL)
        return 0;
    am_error err;
    for (size_t at = 0; at < size;) {
        size_t n = size - at < chunk ? size - at : chunk;
        if (am_session_feed(s, data + at, n, &err) != 0)
            break;
        at += n;
    }
    am_session_close(s);
    return 0;
}

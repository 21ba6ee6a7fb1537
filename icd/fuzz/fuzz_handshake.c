/* libFuzzer: a handshake's answer from whatever answers at the pool's
 * address (a welcome: its limits, its node, its keepalive; a redirect to
 * another node; an error that says where a session lives), read as the
 * session reads it, on an offline session.  Nothing may crash, leak or be
 * undefined. */
#include <stddef.h>
#include <stdint.h>

#include "session.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    am_session *s = am_session_offline(0);
    if (s == NULL)
        return 0;
    am_error err;
    am_session_check_answer(s, data, size, &err);
    am_session_close(s);
    return 0;
}

/* A growable byte buffer, owned by whoever holds the struct (am_buf_free).
 * Used to write frames and JSON text; appending never fails silently: it
 * returns -1 when memory ran out and the buffer stays as it was. */
#ifndef ACCELMIG_BUFFER_H
#define ACCELMIG_BUFFER_H

#include <stddef.h>
#include <stdint.h>

typedef struct am_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
} am_buf;

void am_buf_init(am_buf *buf);
void am_buf_free(am_buf *buf);
int am_buf_reserve(am_buf *buf, size_t more);
int am_buf_append(am_buf *buf, const void *data, size_t len);
int am_buf_puts(am_buf *buf, const char *text);
int am_buf_printf(am_buf *buf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal of UTF-8 `text` (quotes and escapes included). */
int am_buf_json_string(am_buf *buf, const char *text, size_t len);
/* Take the bytes (NUL-terminated): the caller owns them, the buffer is empty. */
char *am_buf_take(am_buf *buf);

#endif

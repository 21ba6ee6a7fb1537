#include "buffer.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void am_buf_init(am_buf *buf) {
    buf->data = NULL;
    buf->len = buf->cap = 0;
}

void am_buf_free(am_buf *buf) {
    free(buf->data);
    am_buf_init(buf);
}

int am_buf_reserve(am_buf *buf, size_t more) {
    if (more > SIZE_MAX - buf->len - 1)
        return -1;
    size_t need = buf->len + more + 1; /* room for a NUL: text stays a C string */
    if (need <= buf->cap)
        return 0;
    size_t cap = buf->cap ? buf->cap : 256;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *data = realloc(buf->data, cap);
    if (data == NULL)
        return -1;
    buf->data = data;
    buf->cap = cap;
    return 0;
}

int am_buf_append(am_buf *buf, const void *data, size_t len) {
    if (am_buf_reserve(buf, len) != 0)
        return -1;
    if (len)
        memcpy(buf->data + buf->len, data, len);
    buf->len += len;
    buf->data[buf->len] = 0;
    return 0;
}

int am_buf_puts(am_buf *buf, const char *text) {
    return am_buf_append(buf, text, strlen(text));
}

int am_buf_printf(am_buf *buf, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(NULL, 0, fmt, args);
    va_end(args);
    if (n < 0 || am_buf_reserve(buf, (size_t)n) != 0)
        return -1;
    va_start(args, fmt);
    vsnprintf((char *)buf->data + buf->len, (size_t)n + 1, fmt, args);
    va_end(args);
    buf->len += (size_t)n;
    return 0;
}

int am_buf_json_string(am_buf *buf, const char *text, size_t len) {
    static const char hex[] = "0123456789abcdef";
    if (am_buf_append(buf, "\"", 1) != 0)
        return -1;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        char esc[7];
        const char *out = NULL;
        size_t n = 0;
        if (c == '"') {
            out = "\\\"", n = 2;
        } else if (c == '\\') {
            out = "\\\\", n = 2;
        } else if (c < 0x20) {
            esc[0] = '\\', esc[1] = 'u', esc[2] = '0', esc[3] = '0';
            esc[4] = hex[c >> 4], esc[5] = hex[c & 15], esc[6] = 0;
            out = esc, n = 6;
        }
        if (out != NULL) {
            if (am_buf_append(buf, out, n) != 0)
                return -1;
        } else if (am_buf_append(buf, &text[i], 1) != 0) {
            return -1;
        }
    }
    return am_buf_append(buf, "\"", 1);
}

char *am_buf_take(am_buf *buf) {
    if (buf->data == NULL && am_buf_reserve(buf, 0) != 0)
        return NULL;
    buf->data[buf->len] = 0;
    char *out = (char *)buf->data;
    am_buf_init(buf);
    return out;
}

#include "json.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

json_object *am_json_parse_header(const char *text, size_t len, char *why, size_t why_len) {
    if (len > INT32_MAX) {
        snprintf(why, why_len, "header of %zu bytes", len);
        return NULL;
    }
    struct json_tokener *tok = json_tokener_new_ex(AM_JSON_MAX_DEPTH);
    if (tok == NULL) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
    json_object *obj = json_tokener_parse_ex(tok, text, (int)len);
    enum json_tokener_error err = json_tokener_get_error(tok);
    size_t used = json_tokener_get_parse_end(tok);
    json_tokener_free(tok);
    if (obj == NULL || err != json_tokener_success) {
        snprintf(why, why_len, "header is not JSON (%s)",
                 err == json_tokener_continue ? "it ends early" : json_tokener_error_desc(err));
        json_object_put(obj);
        return NULL;
    }
    for (; used < len; used++) { /* whitespace only after the object */
        char c = text[used];
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n') {
            snprintf(why, why_len, "junk after the header's JSON");
            json_object_put(obj);
            return NULL;
        }
    }
    if (!json_object_is_type(obj, json_type_object)) {
        snprintf(why, why_len, "header is not a JSON object");
        json_object_put(obj);
        return NULL;
    }
    json_object *op = NULL;
    if (!json_object_object_get_ex(obj, "op", &op) || !json_object_is_type(op, json_type_string)) {
        snprintf(why, why_len, "header has no string 'op'");
        json_object_put(obj);
        return NULL;
    }
    return obj;
}

json_object *am_json_get(json_object *obj, const char *key) {
    json_object *value = NULL;
    if (obj == NULL || !json_object_is_type(obj, json_type_object))
        return NULL;
    if (!json_object_object_get_ex(obj, key, &value))
        return NULL;
    return value;
}

bool am_json_i64(json_object *obj, int64_t *out) {
    if (obj == NULL || !json_object_is_type(obj, json_type_int))
        return false;
    int64_t value = json_object_get_int64(obj);
    if (value == INT64_MAX && json_object_get_uint64(obj) != (uint64_t)INT64_MAX)
        return false; /* above int64: json-c clamps, we refuse */
    *out = value;
    return true;
}

bool am_json_u64(json_object *obj, uint64_t *out) {
    if (obj == NULL || !json_object_is_type(obj, json_type_int))
        return false;
    int64_t value = json_object_get_int64(obj);
    if (value < 0)
        return false;
    if (value == INT64_MAX) {
        *out = json_object_get_uint64(obj); /* kept as uint64 by json-c when larger */
        return true;
    }
    *out = (uint64_t)value;
    return true;
}

bool am_json_u64_max(json_object *obj, uint64_t max, uint64_t *out) {
    uint64_t value;
    if (!am_json_u64(obj, &value) || value > max)
        return false;
    *out = value;
    return true;
}

bool am_json_bool(json_object *obj, bool *out) {
    if (obj == NULL || !json_object_is_type(obj, json_type_boolean))
        return false;
    *out = json_object_get_boolean(obj) != 0;
    return true;
}

const char *am_json_str(json_object *obj, const char *key, size_t *len) {
    json_object *value = am_json_get(obj, key);
    if (value == NULL || !json_object_is_type(value, json_type_string))
        return NULL;
    if (len != NULL)
        *len = (size_t)json_object_get_string_len(value);
    return json_object_get_string(value);
}

const char *am_json_op(json_object *header) {
    const char *op = am_json_str(header, "op", NULL);
    return op != NULL ? op : "";
}

bool am_utf8_valid(const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    while (i < len) {
        unsigned char c = s[i];
        size_t n;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3, cp = c & 0x07;
        } else {
            return false;
        }
        if (len - i <= n)
            return false;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        /* no overlong forms, no surrogates, nothing past U+10FFFF */
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
            return false;
        i += n + 1;
    }
    return true;
}

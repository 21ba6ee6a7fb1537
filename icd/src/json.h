/* Reading what the pool says (JSON headers, json-c) exactly and within
 * bounds: integers as int64/uint64 without a detour through double, strings
 * with their lengths, nothing trusted before it is checked.  Writing is
 * am_buf's (buffer.h). */
#ifndef ACCELMIG_JSON_H
#define ACCELMIG_JSON_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Nesting depth accepted in a header: the deepest the pool sends is the
 * device listing (answer, devices, device, cl, a versions list, a pair). */
#define AM_JSON_MAX_DEPTH 12

/* Parse `len` bytes as one JSON object with a string "op"; NULL (and why
 * in `why`) for anything else: not UTF-8, not strict JSON, too deep, junk
 * after it.  (json-c's strict mode still takes NaN, as a double, and a
 * lone surrogate escape, as U+FFFD: no field reader here accepts a double,
 * and a replacement character is only text.)  The caller owns the result
 * (json_object_put). */
json_object *am_json_parse_header(const char *text, size_t len, char *why, size_t why_len);

json_object *am_json_get(json_object *obj, const char *key);
/* true and *out when `obj` is an integer in range (no float, no bool). */
bool am_json_u64(json_object *obj, uint64_t *out);
bool am_json_i64(json_object *obj, int64_t *out);
bool am_json_u64_max(json_object *obj, uint64_t max, uint64_t *out);
/* A string member's text and length (json-c keeps embedded NULs); NULL if absent or not a string. */
const char *am_json_str(json_object *obj, const char *key, size_t *len);
bool am_json_bool(json_object *obj, bool *out);
/* The op of a header (checked by am_json_parse_header). */
const char *am_json_op(json_object *header);
/* true if `text` is valid UTF-8 (the pool refuses anything else in a header). */
bool am_utf8_valid(const char *text, size_t len);

#endif

#include "frame.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

#define DIRECT_THRESHOLD (64 * 1024)

static uint32_t get_u32be(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get_u64be(const uint8_t *p) {
    return (uint64_t)get_u32be(p) << 32 | get_u32be(p + 4);
}

int am_frame_head(am_buf *out, const char *header_json, size_t header_len, uint64_t payload_len) {
    if (header_len > UINT32_MAX)
        return -1;
    uint8_t prefix[AM_FRAME_PREFIX] = {'A', 'M', AM_FRAME_VERSION, 0};
    uint32_t hlen = (uint32_t)header_len;
    for (int i = 0; i < 4; i++)
        prefix[4 + i] = (uint8_t)(hlen >> (24 - 8 * i));
    for (int i = 0; i < 8; i++)
        prefix[8 + i] = (uint8_t)(payload_len >> (56 - 8 * i));
    if (am_buf_append(out, prefix, sizeof prefix) != 0)
        return -1;
    return am_buf_append(out, header_json, header_len);
}

int am_reader_init(am_reader *r, size_t max_header, uint64_t max_payload, uint64_t max_unsunk, am_sink_fn sink,
                   void *sink_ctx) {
    memset(r, 0, sizeof *r);
    r->max_header = max_header;
    r->max_payload = max_payload;
    r->max_unsunk = max_unsunk;
    r->direct_threshold = DIRECT_THRESHOLD;
    r->staging_size = AM_FRAME_PREFIX + max_header + DIRECT_THRESHOLD;
    if (r->staging_size < 256 * 1024)
        r->staging_size = 256 * 1024; /* a burst of small frames in one read */
    r->staging = malloc(r->staging_size);
    r->sink = sink;
    r->sink_ctx = sink_ctx;
    return r->staging != NULL ? 0 : -1;
}

void am_reader_free(am_reader *r) {
    free(r->staging);
    free(r->owned);
    json_object_put(r->pending_header);
    memset(r, 0, sizeof *r);
}

bool am_reader_idle(const am_reader *r) {
    return r->pending_header == NULL && r->start == r->end;
}

static int fail(am_reader *r, const char *why) {
    snprintf(r->error, sizeof r->error, "%s", why);
    r->broken = true;
    return -1;
}

uint8_t *am_reader_space(am_reader *r, size_t *len) {
    if (r->broken) {
        *len = 0;
        return NULL;
    }
    if (r->pending_header != NULL) {
        uint64_t left = r->dest_size - r->filled;
        *len = left > SIZE_MAX ? SIZE_MAX : (size_t)left;
        return r->dest + r->filled;
    }
    if (r->start == r->end) {
        r->start = r->end = 0;
    } else if (r->staging_size - r->end < AM_FRAME_PREFIX + r->max_header) {
        /* compact: the unparsed tail to the front */
        memmove(r->staging, r->staging + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    *len = r->staging_size - r->end;
    return r->staging + r->end;
}

static int deliver(am_reader *r, json_object *header, const uint8_t *payload, uint64_t len, bool in_sink,
                   am_frame_fn on_frame, void *ctx) {
    int stop = on_frame(ctx, header, payload, len, in_sink);
    json_object_put(header);
    if (stop)
        return fail(r, "stopped by its reader");
    return 0;
}

static int parse(am_reader *r, am_frame_fn on_frame, void *ctx) {
    for (;;) {
        size_t avail = r->end - r->start;
        const uint8_t *p = r->staging + r->start;
        if (avail < AM_FRAME_PREFIX)
            return 0;
        if (p[0] != 'A' || p[1] != 'M')
            return fail(r, "bad magic (not an accelmig pool?)");
        if (p[2] != AM_FRAME_VERSION)
            return fail(r, "frame version this driver does not speak");
        uint32_t hlen = get_u32be(p + 4);
        uint64_t plen = get_u64be(p + 8);
        if (hlen == 0)
            return fail(r, "empty header");
        if (hlen > r->max_header)
            return fail(r, "header over the driver's limit");
        if (plen > r->max_payload)
            return fail(r, "payload over the driver's limit");
        if (avail < AM_FRAME_PREFIX + (size_t)hlen)
            return 0;
        char why[120];
        json_object *header =
            am_json_parse_header((const char *)p + AM_FRAME_PREFIX, hlen, why, sizeof why);
        if (header == NULL)
            return fail(r, why);
        size_t pstart = r->start + AM_FRAME_PREFIX + hlen;
        size_t have = r->end - pstart;
        if (plen <= r->direct_threshold) {
            if (have < plen) {
                json_object_put(header); /* parsed again once the payload is here */
                return 0;
            }
            r->start = pstart + (size_t)plen;
            if (deliver(r, header, r->staging + pstart, plen, false, on_frame, ctx) != 0)
                return -1;
            continue;
        }
        /* a large payload: straight into its own buffer */
        uint8_t *dest = r->sink != NULL ? r->sink(r->sink_ctx, header, plen) : NULL;
        bool in_sink = dest != NULL;
        if (dest == NULL) {
            if (plen > r->max_unsunk) {
                json_object_put(header);
                return fail(r, "a large payload nothing asked for");
            }
            if (plen > SIZE_MAX || (r->owned = malloc((size_t)plen)) == NULL) {
                json_object_put(header);
                return fail(r, "no memory for a payload");
            }
            dest = r->owned;
        }
        size_t take = have < plen ? have : (size_t)plen;
        memcpy(dest, r->staging + pstart, take);
        r->start = pstart + take;
        if (take == plen) {
            int rc = deliver(r, header, dest, plen, in_sink, on_frame, ctx);
            free(r->owned);
            r->owned = NULL;
            if (rc != 0)
                return -1;
            continue;
        }
        r->pending_header = header;
        r->dest = dest;
        r->dest_size = plen;
        r->filled = take;
        r->start = r->end = 0;
        return 0;
    }
}

int am_reader_feed(am_reader *r, size_t n, am_frame_fn on_frame, void *ctx) {
    if (r->broken)
        return -1;
    if (r->pending_header != NULL) {
        r->filled += n;
        if (r->filled < r->dest_size)
            return 0;
        json_object *header = r->pending_header;
        bool in_sink = r->dest != r->owned;
        r->pending_header = NULL;
        int rc = deliver(r, header, r->dest, r->dest_size, in_sink, on_frame, ctx);
        free(r->owned);
        r->owned = NULL;
        r->dest = NULL;
        return rc;
    }
    r->end += n;
    return parse(r, on_frame, ctx);
}

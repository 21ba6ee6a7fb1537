/* The data plane's frames (wire/frames.py): a 16-byte prefix, a JSON
 * header, a raw payload.
 *
 *   "AM" | version u8 | flags u8 | header length u32 BE | payload length u64 BE
 *
 * am_reader is the one incremental decoder of what the pool sends, bounded
 * before anything is trusted: a header of at most max_header bytes, a
 * payload of at most max_payload.  Small frames are parsed out of one
 * staging buffer; a large payload is received straight into its own
 * destination (a read's: the application's memory), asked of `sink`.
 * After an error the reader is broken for good: close the connection. */
#ifndef ACCELMIG_FRAME_H
#define ACCELMIG_FRAME_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buffer.h"

#define AM_FRAME_VERSION 1
#define AM_FRAME_PREFIX 16

/* Append a prefix and header (`header_json`, `header_len` bytes) announcing
 * `payload_len` payload bytes that the caller sends after them. */
int am_frame_head(am_buf *out, const char *header_json, size_t header_len, uint64_t payload_len);

/* Where a large payload goes: `dest` of exactly `size` bytes the caller
 * keeps valid until the frame is delivered, or NULL (the reader allocates). */
typedef void *(*am_sink_fn)(void *ctx, json_object *header, uint64_t size);
/* One whole frame.  `header` is the callback's to keep (json_object_get) or
 * not; `payload` is valid during the call only, unless it is the sink's
 * destination.  Return nonzero to stop (the reader is then broken). */
typedef int (*am_frame_fn)(void *ctx, json_object *header, const uint8_t *payload, uint64_t len,
                           bool in_sink);

typedef struct am_reader {
    uint8_t *staging; /* owned */
    size_t staging_size, start, end;
    size_t max_header;
    uint64_t max_payload;
    size_t direct_threshold;
    uint64_t max_unsunk;        /* a large payload no sink takes: at most this (a peer's claim costs no more) */
    /* a frame whose large payload is being received */
    json_object *pending_header; /* owned while pending */
    uint8_t *dest;               /* the sink's, or `owned` */
    uint8_t *owned;
    uint64_t dest_size, filled;
    am_sink_fn sink;
    void *sink_ctx;
    char error[160];
    bool broken;
} am_reader;

/* `max_payload`: any payload at most; one that no sink takes, at most
 * `max_unsunk` (the reader allocates that one itself). */
int am_reader_init(am_reader *r, size_t max_header, uint64_t max_payload, uint64_t max_unsunk, am_sink_fn sink,
                   void *sink_ctx);
void am_reader_free(am_reader *r);
/* Where the next bytes go, and how many may go there (>0 unless broken). */
uint8_t *am_reader_space(am_reader *r, size_t *len);
/* `n` bytes arrived in the last space: deliver whole frames.  0, or -1 with
 * r->error set (the connection must close). */
int am_reader_feed(am_reader *r, size_t n, am_frame_fn on_frame, void *ctx);
/* True when no partial frame is held. */
bool am_reader_idle(const am_reader *r);

#endif

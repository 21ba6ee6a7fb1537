/* The commands a session sent and has no reply for yet, in sequence order:
 * kept until their reply comes, for the re-send after a cut (the pool says
 * from which sequence number it lacks them: `expect`).  The same
 * bookkeeping as agent/driver/window.py.  Bounded: a full window makes the
 * submitter wait (one command always fits, whatever its size).
 *
 * Ownership: a command belongs to the window from am_window_add until
 * am_window_complete hands it back (or am_window_drain at the end). */
#ifndef ACCELMIG_WINDOW_H
#define ACCELMIG_WINDOW_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "errors.h"

typedef struct am_cmd am_cmd;
/* Called on the session's I/O thread once the command's outcome is known
 * (ok, or its error), without the session's lock. */
typedef void (*am_cmd_hook)(am_cmd *cmd, void *ctx);

struct am_cmd {
    uint64_t seq;
    char op[16];
    char *fields;               /* owned: the header's fields as JSON text, no braces ("" for none) */
    const uint8_t *payload;     /* sent after the header (ours or the application's memory) */
    uint64_t payload_len;
    uint8_t *payload_owned;     /* non-NULL: `payload` is this, freed with the command */
    void *sink;                 /* a read's destination (the caller's), or NULL */
    uint64_t sink_len;
    bool completes;             /* its reply means it completed on the device, with all before it */
    bool waited;                /* a thread waits for it (am_session_wait) and frees it after */
    am_cmd_hook on_reply;
    void *hook_ctx;
    /* the outcome (set by the I/O thread) */
    bool done;
    bool ok;
    am_error error;
    json_object *reply;         /* owned: the reply's header */
    uint8_t *reply_payload;     /* owned: a payload that did not land in `sink` */
    uint64_t reply_payload_len;
    bool payload_in_sink;
};

/* A command to submit: op and fields are copied, the payload is borrowed
 * unless `owned` (then freed with it). NULL when out of memory. */
am_cmd *am_cmd_new(const char *op, const char *fields, const void *payload, uint64_t payload_len, bool owned);
void am_cmd_free(am_cmd *cmd);

typedef struct am_window {
    am_cmd **ring;
    size_t cap, head, count;    /* entries: seq last_seen+1 .. last_seen+count */
    uint64_t next_seq;          /* the next command's sequence number */
    uint64_t last_seen;         /* every reply up to this one arrived */
    uint64_t bytes;
    uint32_t max_commands;
    uint64_t max_bytes;
} am_window;

int am_window_init(am_window *w, uint32_t max_commands, uint64_t max_bytes);
void am_window_free(am_window *w);
bool am_window_has_room(const am_window *w, uint64_t nbytes);
/* Number `cmd` and keep it (-1: out of memory). */
int am_window_add(am_window *w, am_cmd *cmd);
am_cmd *am_window_get(const am_window *w, uint64_t seq);
/* The reply of `seq` arrived: its command, now the caller's; NULL for a
 * duplicate (seq <= last_seen, a replay); -1 in *bad for one out of order. */
am_cmd *am_window_complete(am_window *w, uint64_t seq, bool *bad);
/* Take every command left (oldest first) into `out` (count of them). */
size_t am_window_drain(am_window *w, am_cmd ***out);

#endif

#include "window.h"

#include <stdlib.h>
#include <string.h>

/* a command's bytes in the window: its payload and what it costs besides */
#define CMD_OVERHEAD 128

am_cmd *am_cmd_new(const char *op, const char *fields, const void *payload, uint64_t payload_len, bool owned) {
    am_cmd *cmd = calloc(1, sizeof *cmd);
    if (cmd == NULL)
        return NULL;
    size_t op_len = strlen(op);
    cmd->fields = strdup(fields != NULL ? fields : "");
    if (cmd->fields == NULL || op_len >= sizeof cmd->op) {
        free(cmd->fields);
        free(cmd);
        return NULL;
    }
    memcpy(cmd->op, op, op_len + 1);
    cmd->payload = payload;
    cmd->payload_len = payload_len;
    if (owned)
        cmd->payload_owned = (uint8_t *)payload;
    return cmd;
}

void am_cmd_free(am_cmd *cmd) {
    if (cmd == NULL)
        return;
    free(cmd->fields);
    free(cmd->payload_owned);
    free(cmd->reply_payload);
    json_object_put(cmd->reply);
    free(cmd);
}

int am_window_init(am_window *w, uint32_t max_commands, uint64_t max_bytes) {
    memset(w, 0, sizeof *w);
    w->cap = 64;
    w->ring = calloc(w->cap, sizeof *w->ring);
    w->next_seq = 1;
    w->max_commands = max_commands;
    w->max_bytes = max_bytes;
    return w->ring != NULL ? 0 : -1;
}

void am_window_free(am_window *w) {
    for (size_t i = 0; i < w->count; i++)
        am_cmd_free(w->ring[(w->head + i) % w->cap]);
    free(w->ring);
    memset(w, 0, sizeof *w);
}

bool am_window_has_room(const am_window *w, uint64_t nbytes) {
    if (w->count == 0)
        return true;
    return w->count < w->max_commands && w->bytes + nbytes + CMD_OVERHEAD <= w->max_bytes;
}

int am_window_add(am_window *w, am_cmd *cmd) {
    if (w->count == w->cap) {
        size_t cap = w->cap * 2;
        am_cmd **ring = calloc(cap, sizeof *ring);
        if (ring == NULL)
            return -1;
        for (size_t i = 0; i < w->count; i++)
            ring[i] = w->ring[(w->head + i) % w->cap];
        free(w->ring);
        w->ring = ring;
        w->cap = cap;
        w->head = 0;
    }
    cmd->seq = w->next_seq++;
    w->ring[(w->head + w->count) % w->cap] = cmd;
    w->count++;
    w->bytes += cmd->payload_len + CMD_OVERHEAD;
    return 0;
}

am_cmd *am_window_get(const am_window *w, uint64_t seq) {
    if (seq <= w->last_seen || seq - w->last_seen > w->count)
        return NULL;
    return w->ring[(w->head + (size_t)(seq - w->last_seen - 1)) % w->cap];
}

am_cmd *am_window_complete(am_window *w, uint64_t seq, bool *bad) {
    *bad = false;
    if (seq <= w->last_seen)
        return NULL;
    if (seq != w->last_seen + 1 || w->count == 0) {
        *bad = true;
        return NULL;
    }
    am_cmd *cmd = w->ring[w->head];
    w->ring[w->head] = NULL;
    w->head = (w->head + 1) % w->cap;
    w->count--;
    w->last_seen = seq;
    w->bytes -= cmd->payload_len + CMD_OVERHEAD;
    return cmd;
}

size_t am_window_drain(am_window *w, am_cmd ***out) {
    size_t n = w->count;
    am_cmd **all = n ? calloc(n, sizeof *all) : NULL;
    if (n && all == NULL) {
        *out = NULL;
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        all[i] = w->ring[(w->head + i) % w->cap];
        w->ring[(w->head + i) % w->cap] = NULL;
    }
    w->head = 0;
    w->count = 0;
    w->bytes = 0;
    w->last_seen = w->next_seq - 1;
    *out = all;
    return n;
}

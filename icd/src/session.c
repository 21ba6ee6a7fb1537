#include "session.h"

#include <errno.h>
#include <inttypes.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include "buffer.h"
#include "frame.h"
#include "json.h"
#include "link.h"
#include "log.h"

/* payloads up to this size are copied into the outgoing stream (one
 * write for a burst of small frames); larger ones go from their own memory */
#define SMALL_PAYLOAD (16 * 1024)
/* the outgoing stream is filled up to this size before it is written */
#define OUT_FILL (256 * 1024)
/* replies the I/O thread lets pile up before it acknowledges at once */
#define ACK_EVERY 256
/* s an acknowledgement may wait for a command to carry it */
#define ACK_IDLE 0.1
/* s: the first and the longest wait between reconnection attempts */
#define BACKOFF_FIRST 0.05
#define BACKOFF_LONGEST 2.0
/* what the pool may send: a device listing's header is the largest one */
#define MAX_HEADER (1u << 20)
#define MAX_PAYLOAD (1ull << 40)
/* a payload no command waits with a destination for: at most this */
#define MAX_UNSUNK (1u << 20)
/* a transfer's chunk at most (agent/driver/transfer.py's TRANSFER_CHUNK) */
#define CHUNK (64ull << 20)
#define SECRET_BYTES 32

enum am_state { ST_CONNECTING, ST_CONNECTED, ST_DISCONNECTED, ST_RESUMING, ST_FAILED, ST_CLOSED, ST_COUNT };

static const char *const STATE_NAMES[ST_COUNT] = {"connecting", "connected", "disconnected",
                                                   "resuming", "failed", "closed"};
#define TO(state) (1u << (state))
/* every state change goes through this table (state_to) */
static const unsigned TRANSITIONS[ST_COUNT] = {
    [ST_CONNECTING] = TO(ST_CONNECTED) | TO(ST_FAILED) | TO(ST_CLOSED),
    [ST_CONNECTED] = TO(ST_DISCONNECTED) | TO(ST_FAILED) | TO(ST_CLOSED),
    [ST_DISCONNECTED] = TO(ST_RESUMING) | TO(ST_FAILED) | TO(ST_CLOSED),
    [ST_RESUMING] = TO(ST_CONNECTED) | TO(ST_DISCONNECTED) | TO(ST_FAILED) | TO(ST_CLOSED),
    [ST_FAILED] = TO(ST_CLOSED),
    [ST_CLOSED] = 0,
};

/* a frame that came with a handshake's answer, for the normal dispatch after it */
typedef struct early_frame {
    json_object *header;
    uint8_t *payload;          /* owned, unless in its command's sink already */
    uint64_t len;
    bool in_sink;
} early_frame;

struct am_session {
    pthread_mutex_t mu;
    pthread_cond_t cond;       /* replies, state changes, room in the window */
    enum am_state state;
    am_error failure;
    am_error last_error;
    bool closing;
    double disconnected_since;
    am_session_hooks hooks;
    /* identity (the secret never leaves this process but in `open`) */
    char sid[128];
    uint64_t epoch;
    unsigned char secret[SECRET_BYTES];
    char endpoint[320];
    char challenge[128];
    char device_id[64];
    double timeout, connect_timeout;
    SSL_CTX *tls;              /* borrowed: the platform's */
    uint64_t chunk;
    /* commands */
    am_window window;
    uint64_t next_handle;
    uint64_t completed_upto;      /* every command up to it completed on the device */
    uint64_t sync_pending_upto;   /* the last command in flight whose reply will say so */
    /* the I/O thread's own */
    am_link link;
    am_reader reader;
    int wake_fd;
    pthread_t thread;
    bool thread_started;
    uint64_t send_next;        /* the next command to send (guarded by mu: resume sets it) */
    uint64_t acked_sent;
    double last_send;
    am_buf out;
    size_t out_pos;
    am_cmd *big;               /* a command whose large payload is being written */
    uint64_t big_pos;
    short out_want;            /* what a blocked write waits for (0: not blocked) */
    am_cmd **batch;            /* the replies of the last read: hooks run without mu */
    size_t batch_count, batch_cap;
    bool capture;              /* handshake: frames are kept as answers */
    early_frame *early;
    size_t early_count, early_cap;
    am_error frame_error;      /* an "error" frame, or why a frame was refused */
    bool frame_failed;
};

static void state_to(am_session *s, enum am_state to) {
    if (!(TRANSITIONS[s->state] & TO(to))) {
        am_error_log("session %s: no transition %s -> %s (ignored)", s->sid, STATE_NAMES[s->state],
                     STATE_NAMES[to]);
        return;
    }
    am_debug("session %s: %s -> %s", s->sid, STATE_NAMES[s->state], STATE_NAMES[to]);
    s->state = to;
    pthread_cond_broadcast(&s->cond);
}

static void wake(am_session *s) {
    uint64_t one = 1;
    ssize_t n = write(s->wake_fd, &one, sizeof one);
    (void)n; /* (full: the thread is awake already) */
}

void am_ownership_proof(const unsigned char *secret, size_t secret_len, const char *challenge, const char *sid,
                        uint64_t epoch, const unsigned char *binding, size_t binding_len, char out[65]) {
    am_buf msg;
    am_buf_init(&msg);
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int mac_len = 0;
    out[0] = 0;
    if (am_buf_printf(&msg, "%s|%s|%" PRIu64, challenge, sid, epoch) != 0 ||
        (binding_len && (am_buf_append(&msg, "|", 1) != 0 || am_buf_append(&msg, binding, binding_len) != 0)) ||
        HMAC(EVP_sha256(), secret, (int)secret_len, msg.data, msg.len, mac, &mac_len) == NULL) {
        am_buf_free(&msg);
        return;
    }
    am_buf_free(&msg);
    static const char hex[] = "0123456789abcdef";
    for (unsigned i = 0; i < mac_len && i < 32; i++) {
        out[2 * i] = hex[mac[i] >> 4];
        out[2 * i + 1] = hex[mac[i] & 15];
    }
    out[2 * (mac_len < 32 ? mac_len : 32)] = 0;
}

/* -- frames in --------------------------------------------------------------------- */

static int keep_early(am_session *s, json_object *header, const uint8_t *payload, uint64_t len, bool in_sink) {
    if (s->early_count == s->early_cap) {
        size_t cap = s->early_cap ? s->early_cap * 2 : 8;
        early_frame *more = realloc(s->early, cap * sizeof *more);
        if (more == NULL)
            return -1;
        s->early = more;
        s->early_cap = cap;
    }
    uint8_t *copy = NULL;
    if (len && !in_sink) {
        copy = malloc((size_t)len);
        if (copy == NULL)
            return -1;
        memcpy(copy, payload, (size_t)len);
    }
    s->early[s->early_count++] = (early_frame){json_object_get(header), copy, len, in_sink};
    return 0;
}

/* Room for `more` replies in the batch, before any is taken from the
 * window (a reply taken must reach its waiter or its hook: no failure after). */
static int batch_reserve(am_session *s, size_t more) {
    if (s->batch_cap - s->batch_count >= more)
        return 0;
    size_t cap = s->batch_cap ? s->batch_cap : 64;
    while (cap - s->batch_count < more)
        cap *= 2;
    am_cmd **bigger = realloc(s->batch, cap * sizeof *bigger);
    if (bigger == NULL)
        return -1;
    s->batch = bigger;
    s->batch_cap = cap;
    return 0;
}

static int refuse_frame(am_session *s, const char *why) {
    am_error_set(&s->frame_error, "PROTOCOL_ERROR", "protocol error: %s", why);
    s->frame_failed = true;
    return 1;
}

/* a read's payload straight into the application's memory, when it waits with room for it */
static void *payload_sink(void *ctx, json_object *header, uint64_t size) {
    am_session *s = ctx;
    uint64_t seq;
    bool ok = false;
    if (strcmp(am_json_op(header), "reply") != 0 || !am_json_u64(am_json_get(header, "seq"), &seq) ||
        !am_json_bool(am_json_get(header, "ok"), &ok) || !ok)
        return NULL;
    pthread_mutex_lock(&s->mu);
    am_cmd *cmd = am_window_get(&s->window, seq);
    void *dest = cmd != NULL && cmd->sink != NULL && cmd->sink_len == size ? cmd->sink : NULL;
    pthread_mutex_unlock(&s->mu);
    return dest;
}

/* A reply's outcome into its command (which is then the batch's). */
static void take_reply(am_session *s, am_cmd *cmd, bool ok, json_object *header, const uint8_t *payload,
                       uint64_t len, bool in_sink) {
    cmd->ok = ok;
    cmd->reply = json_object_get(header);
    if (!ok)
        am_error_from_wire(&cmd->error, am_json_get(header, "error"));
    if (in_sink) {
        cmd->payload_in_sink = true;
    } else if (len > 0 && cmd->sink != NULL && cmd->sink_len == len) {
        memcpy(cmd->sink, payload, (size_t)len);
        cmd->payload_in_sink = true;
    } else if (len > 0) {
        cmd->reply_payload = malloc((size_t)len);
        if (cmd->reply_payload == NULL) {
            cmd->ok = false;
            am_error_set(&cmd->error, "INTERNAL", "out of memory for a reply of %" PRIu64 " bytes", len);
        } else {
            memcpy(cmd->reply_payload, payload, (size_t)len);
            cmd->reply_payload_len = len;
        }
    }
    s->batch[s->batch_count++] = cmd;
}

static int on_frame(void *ctx, json_object *header, const uint8_t *payload, uint64_t len, bool in_sink) {
    am_session *s = ctx;
    if (s->capture)
        return keep_early(s, header, payload, len, in_sink) == 0 ? 0 : refuse_frame(s, "out of memory");
    if (s->frame_failed)
        return 1; /* (refused before: nothing after it counts) */
    const char *op = am_json_op(header);
    if (strcmp(op, "reply") == 0) {
        /* everything checked before the window changes: a refused frame changes nothing */
        uint64_t seq;
        bool ok;
        if (!am_json_u64(am_json_get(header, "seq"), &seq) || !am_json_bool(am_json_get(header, "ok"), &ok))
            return refuse_frame(s, "a reply without seq or ok");
        if (batch_reserve(s, 1) != 0)
            return refuse_frame(s, "out of memory");
        bool bad;
        pthread_mutex_lock(&s->mu);
        am_cmd *cmd = am_window_complete(&s->window, seq, &bad);
        pthread_mutex_unlock(&s->mu);
        if (bad)
            return refuse_frame(s, "a reply out of order");
        if (cmd == NULL)
            return 0; /* a replayed reply of a command answered before */
        take_reply(s, cmd, ok, header, payload, len, in_sink);
        return 0;
    }
    if (strcmp(op, "done") == 0) {
        uint64_t first, last;
        if (!am_json_u64(am_json_get(header, "from"), &first) || !am_json_u64(am_json_get(header, "to"), &last) ||
            last < first || len != 0)
            return refuse_frame(s, "a done frame without its range");
        pthread_mutex_lock(&s->mu);
        uint64_t last_seen = s->window.last_seen;
        bool fits = last < s->window.next_seq && first <= last_seen + 1;
        pthread_mutex_unlock(&s->mu);
        if (!fits)
            return refuse_frame(s, "a done frame past what was sent, or out of order");
        if (last > last_seen && batch_reserve(s, (size_t)(last - last_seen)) != 0)
            return refuse_frame(s, "out of memory");
        pthread_mutex_lock(&s->mu);
        for (uint64_t seq = last_seen + 1; seq <= last; seq++) {
            bool bad;
            am_cmd *cmd = am_window_complete(&s->window, seq, &bad);
            if (cmd == NULL)
                continue; /* (none: the window was checked above, under the one thread that completes) */
            cmd->ok = true;
            s->batch[s->batch_count++] = cmd;
        }
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    if (strcmp(op, "error") == 0) {
        am_error_from_wire(&s->frame_error, am_json_get(header, "error"));
        s->frame_failed = true;
        return 1;
    }
    return refuse_frame(s, "an unexpected frame from the pool");
}

/* -- the handshake (open, resume, list_devices) ------------------------------------ */

static void drop_early(am_session *s) {
    for (size_t i = 0; i < s->early_count; i++) {
        json_object_put(s->early[i].header);
        free(s->early[i].payload);
    }
    s->early_count = 0;
}

/* The next frame of a handshake (the caller owns it), or NULL and why. */
static json_object *next_answer(am_session *s, double deadline, am_error *err) {
    while (s->early_count == 0) {
        size_t space_len;
        uint8_t *space = am_reader_space(&s->reader, &space_len);
        if (space == NULL) {
            am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", s->reader.error);
            return NULL;
        }
        ssize_t n = am_link_recv(&s->link, space, space_len, deadline, err);
        if (n == 0)
            am_error_set(err, "UNAVAILABLE", "the pool is unavailable: connection closed during the handshake%s",
                         s->link.ssl == NULL && s->reader.end == 0
                             ? " (a pool that serves TLS closes plain connections: this driver is insecure)"
                             : "");
        if (n <= 0)
            return NULL;
        if (s->link.ssl == NULL && s->reader.end == 0 && n >= 2 && space[0] == 0x16 && space[1] == 3) {
            am_error_set(err, "AUTH_FAILED", "authentication failed: the pool answers in TLS and this driver is "
                         "insecure (plain TCP): give it a CA file instead (ACCELMIG_CAFILE)");
            return NULL;
        }
        if (am_reader_feed(&s->reader, (size_t)n, on_frame, s) != 0) {
            am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", s->reader.error);
            return NULL;
        }
    }
    json_object *answer = s->early[0].header;
    free(s->early[0].payload);
    memmove(s->early, s->early + 1, (s->early_count - 1) * sizeof *s->early);
    s->early_count--;
    if (strcmp(am_json_op(answer), "error") == 0) {
        am_error_from_wire(err, am_json_get(answer, "error"));
        json_object_put(answer);
        return NULL;
    }
    return answer;
}

static int send_frame(am_session *s, const char *header, double deadline, am_error *err) {
    am_buf frame;
    am_buf_init(&frame);
    int rc = am_frame_head(&frame, header, strlen(header), 0);
    if (rc == 0)
        rc = am_link_send_all(&s->link, frame.data, frame.len, deadline, err);
    else
        am_error_set(err, "INTERNAL", "out of memory");
    am_buf_free(&frame);
    return rc;
}

/* Connect and say hello: the welcome's challenge and limits kept. `then`: a
 * frame sent with the hello (it needs nothing of the welcome). */
static int dial(am_session *s, const char *endpoint, double timeout, const char *then, am_error *err) {
    double deadline = am_now() + timeout;
    am_reader_free(&s->reader);
    drop_early(s);
    if (am_reader_init(&s->reader, MAX_HEADER, MAX_PAYLOAD, MAX_UNSUNK, payload_sink, s) != 0) {
        am_error_set(err, "INTERNAL", "out of memory");
        return -1;
    }
    if (am_link_dial(&s->link, s->tls, endpoint, timeout, err) != 0)
        return -1;
    s->capture = true;
    char hello[64];
    snprintf(hello, sizeof hello, "{\"op\":\"hello\",\"versions\":[%d]}", AM_PROTOCOL_VERSION);
    if (send_frame(s, hello, deadline, err) != 0 || (then != NULL && send_frame(s, then, deadline, err) != 0))
        goto fail;
    json_object *welcome = next_answer(s, deadline, err);
    if (welcome == NULL) {
        if (strcmp(err->code, "VERSION_UNSUPPORTED") == 0) {
            char said[sizeof err->message];
            snprintf(said, sizeof said, "%s", err->message);
            am_error_set(err, "VERSION_UNSUPPORTED", "the pool at %s does not speak data-plane protocol %d (the "
                         "OpenCL driver needs it: upgrade the pool): %.300s", endpoint, AM_PROTOCOL_VERSION, said);
        }
        goto fail;
    }
    uint64_t version = 0, max_payload = CHUNK;
    size_t challenge_len = 0;
    const char *challenge = am_json_str(welcome, "challenge", &challenge_len);
    json_object *limit = am_json_get(welcome, "max_payload");
    if (strcmp(am_json_op(welcome), "welcome") != 0 || !am_json_u64(am_json_get(welcome, "version"), &version) ||
        version != AM_PROTOCOL_VERSION || challenge == NULL || challenge_len >= sizeof s->challenge ||
        (limit != NULL && (!am_json_u64(limit, &max_payload) || max_payload < 4096))) {
        am_error_set(err, version && version != AM_PROTOCOL_VERSION ? "VERSION_UNSUPPORTED" : "PROTOCOL_ERROR",
                     "the pool at %s does not speak data-plane protocol %d (the OpenCL driver needs it: "
                     "upgrade the pool)", endpoint, AM_PROTOCOL_VERSION);
        json_object_put(welcome);
        goto fail;
    }
    memcpy(s->challenge, challenge, challenge_len + 1);
    s->chunk = max_payload < CHUNK ? max_payload : CHUNK;
    json_object_put(welcome);
    return 0;
fail:
    am_link_close(&s->link);
    s->capture = false;
    return -1;
}

/* After a handshake: frames that came with its answer go the normal way. */
static int end_handshake(am_session *s) {
    s->capture = false;
    int rc = 0;
    for (size_t i = 0; i < s->early_count && rc == 0; i++)
        rc = on_frame(s, s->early[i].header, s->early[i].payload, s->early[i].len, s->early[i].in_sink);
    drop_early(s);
    return rc;
}

json_object *am_list_devices(const am_config *cfg, SSL_CTX *tls, am_error *err) {
    am_session probe;
    memset(&probe, 0, sizeof probe);
    pthread_mutex_init(&probe.mu, NULL);
    probe.tls = tls;
    probe.link.fd = -1;
    am_buf request;
    am_buf_init(&request);
    json_object *answer = NULL;
    if (am_buf_puts(&request, "{\"op\":\"list_devices\",\"token\":") != 0 ||
        am_buf_json_string(&request, cfg->token, strlen(cfg->token)) != 0 || am_buf_puts(&request, "}") != 0) {
        am_error_set(err, "INTERNAL", "out of memory");
        goto done;
    }
    if (dial(&probe, cfg->endpoint, cfg->connect_timeout, (const char *)request.data, err) != 0)
        goto done;
    answer = next_answer(&probe, am_now() + cfg->connect_timeout, err);
    if (answer != NULL && strcmp(am_json_op(answer), "devices") != 0) {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: the pool answered list_devices with %.40s",
                     am_json_op(answer));
        json_object_put(answer);
        answer = NULL;
    }
done:
    am_buf_free(&request);
    am_link_close(&probe.link);
    am_reader_free(&probe.reader);
    drop_early(&probe);
    free(probe.early);
    pthread_mutex_destroy(&probe.mu);
    return answer;
}

/* -- the I/O thread: writing -------------------------------------------------------- */

static void reset_stream(am_session *s) {
    s->out.len = 0;
    s->out_pos = 0;
    s->big = NULL;
    s->big_pos = 0;
    s->out_want = 0;
}

/* The next frames to write, from the window (mu held). */
static int fill_out(am_session *s) {
    while (s->big == NULL && s->out.len < OUT_FILL && s->send_next < s->window.next_seq) {
        am_cmd *cmd = am_window_get(&s->window, s->send_next);
        if (cmd == NULL) { /* answered meanwhile (a replay): nothing to send */
            s->send_next++;
            continue;
        }
        char head[160];
        int n = snprintf(head, sizeof head, "{\"op\":\"%s\",\"seq\":%" PRIu64 ",\"epoch\":%" PRIu64
                         ",\"ack\":%" PRIu64 "%s", cmd->op, cmd->seq, s->epoch, s->window.last_seen,
                         cmd->fields[0] ? "," : "");
        am_buf header;
        am_buf_init(&header);
        if (n < 0 || am_buf_append(&header, head, (size_t)n) != 0 || am_buf_puts(&header, cmd->fields) != 0 ||
            am_buf_puts(&header, "}") != 0 ||
            am_frame_head(&s->out, (const char *)header.data, header.len, cmd->payload_len) != 0) {
            am_buf_free(&header);
            return -1;
        }
        am_buf_free(&header);
        if (cmd->payload_len <= SMALL_PAYLOAD) {
            if (am_buf_append(&s->out, cmd->payload, (size_t)cmd->payload_len) != 0)
                return -1;
        } else {
            s->big = cmd;
            s->big_pos = 0;
        }
        if (s->window.last_seen > s->acked_sent)
            s->acked_sent = s->window.last_seen;
        s->send_next++;
    }
    if (s->big == NULL && s->out.len == 0 && s->window.last_seen > s->acked_sent &&
        (s->window.last_seen - s->acked_sent >= ACK_EVERY || am_now() - s->last_send >= ACK_IDLE)) {
        char ack[64];
        int n = snprintf(ack, sizeof ack, "{\"op\":\"ack\",\"ack\":%" PRIu64 "}", s->window.last_seen);
        if (n < 0 || am_frame_head(&s->out, ack, (size_t)n, 0) != 0)
            return -1;
        s->acked_sent = s->window.last_seen;
    }
    return 0;
}

/* Write what can be written now: 0 (done, or blocked: out_want says on
 * what), -1 when the link failed (err). */
static int flush_writes(am_session *s, am_error *err) {
    s->out_want = 0;
    for (;;) {
        const uint8_t *data = NULL;
        size_t len = 0;
        if (s->out_pos < s->out.len) {
            data = s->out.data + s->out_pos;
            len = s->out.len - s->out_pos;
        } else if (s->big != NULL) {
            s->out.len = s->out_pos = 0;
            data = s->big->payload + s->big_pos;
            uint64_t left = s->big->payload_len - s->big_pos;
            len = left > (1u << 30) ? (1u << 30) : (size_t)left;
        } else {
            s->out.len = s->out_pos = 0;
            pthread_mutex_lock(&s->mu);
            int rc = fill_out(s);
            pthread_mutex_unlock(&s->mu);
            if (rc != 0) {
                am_error_set(err, "INTERNAL", "out of memory");
                return -1;
            }
            if (s->out.len == 0 && s->big == NULL)
                return 0;
            continue;
        }
        short want = 0;
        ssize_t n = am_link_write(&s->link, data, len, &want, err);
        if (n == AM_LINK_AGAIN) {
            s->out_want = want;
            return 0;
        }
        if (n < 0)
            return -1;
        s->last_send = am_now();
        if (s->out_pos < s->out.len) {
            s->out_pos += (size_t)n;
        } else {
            s->big_pos += (uint64_t)n;
            if (s->big_pos == s->big->payload_len)
                s->big = NULL;
        }
    }
}

/* -- the I/O thread: replies -------------------------------------------------------- */

static bool reply_has_times(const am_cmd *cmd) {
    return cmd->reply != NULL && am_json_get(cmd->reply, "times") != NULL;
}

/* Hooks, completion, and the waiters' wake-up for the replies of the last read. */
static void settle_batch(am_session *s) {
    if (s->batch_count == 0)
        return;
    for (size_t i = 0; i < s->batch_count; i++)
        if (s->batch[i]->on_reply != NULL)
            s->batch[i]->on_reply(s->batch[i], s->batch[i]->hook_ctx);
    pthread_mutex_lock(&s->mu);
    uint64_t upto = s->completed_upto;
    for (size_t i = 0; i < s->batch_count; i++) {
        am_cmd *cmd = s->batch[i];
        if (cmd->ok && (cmd->completes || reply_has_times(cmd)) && cmd->seq > upto)
            upto = cmd->seq;
        else if (!cmd->ok && cmd->completes && cmd->seq == s->sync_pending_upto)
            s->sync_pending_upto = s->completed_upto; /* it will not say so: a finish must */
    }
    bool advanced = upto > s->completed_upto;
    s->completed_upto = upto;
    pthread_mutex_unlock(&s->mu);
    if (advanced && s->hooks.completed != NULL)
        s->hooks.completed(s->hooks.ctx, upto);
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->batch_count; i++) {
        if (s->batch[i]->waited)
            s->batch[i]->done = true;
        else
            am_cmd_free(s->batch[i]);
    }
    s->batch_count = 0;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
}

/* Read what is there: 0 (nothing more now), -1 when the link is gone (err). */
static int pump_reads(am_session *s, am_error *err) {
    for (int rounds = 0; rounds < 64; rounds++) {
        size_t space_len;
        uint8_t *space = am_reader_space(&s->reader, &space_len);
        short want = 0;
        ssize_t n = space != NULL ? am_link_read(&s->link, space, space_len, &want, err) : -1;
        if (n == AM_LINK_AGAIN) {
            if (want == POLLOUT)
                s->out_want = POLLOUT;
            return 0;
        }
        if (n == 0)
            am_error_set(err, "UNAVAILABLE", "the pool is unavailable: connection closed");
        if (n <= 0)
            return -1;
        int rc = am_reader_feed(&s->reader, (size_t)n, on_frame, s);
        settle_batch(s);
        if (rc != 0) {
            if (s->frame_failed)
                *err = s->frame_error;
            else
                am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", s->reader.error);
            s->frame_failed = false;
            return -1;
        }
    }
    return 0;
}

/* -- failure, loss, resume ---------------------------------------------------------- */

static void fail_session(am_session *s, const am_error *why) {
    pthread_mutex_lock(&s->mu);
    if (s->state == ST_FAILED || s->state == ST_CLOSED) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->failure = *why;
    state_to(s, ST_FAILED);
    am_cmd **left = NULL;
    size_t count = am_window_drain(&s->window, &left);
    pthread_mutex_unlock(&s->mu);
    am_error_log("session %s failed: %s: %s", s->sid, why->code, why->message);
    reset_stream(s);
    for (size_t i = 0; i < count; i++) {
        left[i]->ok = false;
        left[i]->error = *why;
        if (left[i]->on_reply != NULL)
            left[i]->on_reply(left[i], left[i]->hook_ctx);
    }
    if (s->hooks.failed != NULL)
        s->hooks.failed(s->hooks.ctx, why);
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < count; i++) {
        if (left[i]->waited)
            left[i]->done = true;
        else
            am_cmd_free(left[i]);
    }
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    free(left);
}

static void link_lost(am_session *s, const am_error *why) {
    am_link_close(&s->link);
    reset_stream(s);
    if (am_error_terminal(why)) {
        fail_session(s, why);
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (s->state == ST_CONNECTED || s->state == ST_RESUMING) {
        state_to(s, ST_DISCONNECTED);
        s->disconnected_since = am_now();
        s->last_error = *why;
    }
    pthread_mutex_unlock(&s->mu);
    am_warn("session %s: connection lost (%s: %s)", s->sid, why->code, why->message);
}

/* One resume attempt (I/O thread): 0 (connected), -1 (err; terminal or not). */
static int try_resume(am_session *s, am_error *err) {
    pthread_mutex_lock(&s->mu);
    if (s->state != ST_DISCONNECTED) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    state_to(s, ST_RESUMING);
    uint64_t last_seen = s->window.last_seen, next_seq = s->window.next_seq, epoch = s->epoch;
    pthread_mutex_unlock(&s->mu);
    double started = am_now();
    double timeout = s->connect_timeout < 2.0 ? s->connect_timeout : 2.0;
    if (dial(s, s->endpoint, timeout, NULL, err) != 0)
        goto fail;
    char proof[65];
    am_ownership_proof(s->secret, sizeof s->secret, s->challenge, s->sid, epoch, s->link.binding,
                       s->link.binding_len, proof);
    char request[512];
    snprintf(request, sizeof request, "{\"op\":\"resume\",\"sid\":\"%s\",\"epoch\":%" PRIu64 ",\"last_seen\":%" PRIu64
             ",\"next_seq\":%" PRIu64 ",\"proof\":\"%s\"}", s->sid, epoch, last_seen, next_seq, proof);
    double deadline = am_now() + timeout;
    if (send_frame(s, request, deadline, err) != 0)
        goto fail_link;
    json_object *answer = next_answer(s, deadline, err);
    if (answer == NULL)
        goto fail_link;
    uint64_t new_epoch, expect;
    if (strcmp(am_json_op(answer), "resumed") != 0 || !am_json_u64(am_json_get(answer, "epoch"), &new_epoch) ||
        !am_json_u64(am_json_get(answer, "expect"), &expect) || expect > next_seq || expect == 0) {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: an odd answer to a resume");
        json_object_put(answer);
        goto fail_link;
    }
    json_object_put(answer);
    pthread_mutex_lock(&s->mu);
    s->epoch = new_epoch;
    s->send_next = expect;           /* re-send exactly what the pool lacks */
    s->acked_sent = last_seen;
    reset_stream(s);
    state_to(s, ST_CONNECTED);
    pthread_mutex_unlock(&s->mu);
    if (end_handshake(s) != 0) {     /* replayed replies that came with the answer */
        settle_batch(s);
        *err = s->frame_error;
        s->frame_failed = false;
        link_lost(s, err);
        return -1;
    }
    settle_batch(s);
    am_info("session %s resumed at %s: epoch %" PRIu64 ", re-sending from %" PRIu64 ", %.1f ms", s->sid,
            s->endpoint, new_epoch, expect, (am_now() - started) * 1000);
    return 0;
fail_link:
    am_link_close(&s->link);
fail:
    s->capture = false;
    drop_early(s);
    pthread_mutex_lock(&s->mu);
    if (s->state == ST_RESUMING)
        state_to(s, ST_DISCONNECTED);
    pthread_mutex_unlock(&s->mu);
    if (am_error_terminal(err))
        fail_session(s, err);
    return -1;
}

static void drain_wake(am_session *s) {
    uint64_t count;
    while (read(s->wake_fd, &count, sizeof count) > 0) {
    }
}

static void *io_main(void *arg) {
    am_session *s = arg;
    double backoff = BACKOFF_FIRST;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        enum am_state state = s->state;
        bool closing = s->closing;
        double since = s->disconnected_since;
        pthread_mutex_unlock(&s->mu);
        if (closing || state == ST_FAILED || state == ST_CLOSED)
            break;
        am_error err = {0};
        if (state == ST_DISCONNECTED) {
            if (am_now() - since > s->timeout) {
                am_error_set(&err, "DISCONNECTED", "no connection to the pool within %.1f s (%s)", s->timeout,
                             s->last_error.message);
                fail_session(s, &err);
                break;
            }
            struct pollfd pfd = {.fd = s->wake_fd, .events = POLLIN};
            poll(&pfd, 1, (int)(backoff * 1000));
            drain_wake(s);
            pthread_mutex_lock(&s->mu);
            closing = s->closing;
            pthread_mutex_unlock(&s->mu);
            if (closing)
                break;
            if (try_resume(s, &err) == 0)
                backoff = BACKOFF_FIRST;
            else
                backoff = backoff * 2 > BACKOFF_LONGEST ? BACKOFF_LONGEST : backoff * 2;
            continue;
        }
        if (flush_writes(s, &err) != 0) {
            link_lost(s, &err);
            continue;
        }
        struct pollfd pfds[2] = {{.fd = s->link.fd, .events = (short)(POLLIN | (s->out_want == POLLOUT ? POLLOUT : 0))},
                                 {.fd = s->wake_fd, .events = POLLIN}};
        pthread_mutex_lock(&s->mu);
        bool ack_due = s->window.last_seen > s->acked_sent;
        pthread_mutex_unlock(&s->mu);
        int wait_ms = am_link_buffered(&s->link) ? 0 : ack_due ? (int)(ACK_IDLE * 1000) : 1000;
        int ready = poll(pfds, 2, wait_ms);
        if (ready < 0 && errno != EINTR) {
            am_error_set(&err, "INTERNAL", "poll: %s", strerror(errno));
            link_lost(s, &err);
            continue;
        }
        if (pfds[1].revents)
            drain_wake(s);
        if ((pfds[0].revents & (POLLIN | POLLERR | POLLHUP)) || am_link_buffered(&s->link) ||
            s->out_want == POLLIN) {
            if (pump_reads(s, &err) != 0) {
                link_lost(s, &err);
                continue;
            }
        }
    }
    am_link_close(&s->link);
    return NULL;
}

/* -- the application's side --------------------------------------------------------- */

static am_session *session_new(const am_config *cfg, SSL_CTX *tls, const am_session_hooks *hooks) {
    am_session *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->link.fd = -1;
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->wake_fd < 0 || am_window_init(&s->window, cfg->window_commands, cfg->window_bytes) != 0 ||
        getrandom(s->secret, sizeof s->secret, 0) != (ssize_t)sizeof s->secret) {
        if (s->wake_fd >= 0)
            close(s->wake_fd);
        am_window_free(&s->window);
        free(s);
        return NULL;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cond, &attr);
    pthread_condattr_destroy(&attr);
    am_buf_init(&s->out);
    s->tls = tls;
    s->timeout = cfg->timeout;
    s->connect_timeout = cfg->connect_timeout;
    s->next_handle = 1;
    s->send_next = 1;
    s->chunk = CHUNK;
    snprintf(s->endpoint, sizeof s->endpoint, "%s", cfg->endpoint);
    if (hooks != NULL)
        s->hooks = *hooks;
    return s;
}

static void session_free(am_session *s) {
    am_link_close(&s->link);
    am_reader_free(&s->reader);
    drop_early(s);
    free(s->early);
    free(s->batch);
    am_buf_free(&s->out);
    am_window_free(&s->window);
    close(s->wake_fd);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    OPENSSL_cleanse(s->secret, sizeof s->secret);
    free(s);
}

am_session *am_session_open(const am_config *cfg, SSL_CTX *tls, const char *device_id,
                            const am_session_hooks *hooks, am_error *err) {
    am_session *s = session_new(cfg, tls, hooks);
    if (s == NULL) {
        am_error_set(err, "INTERNAL", "out of memory");
        return NULL;
    }
    snprintf(s->device_id, sizeof s->device_id, "%s", device_id);
    char secret_hex[2 * SECRET_BYTES + 1];
    for (size_t i = 0; i < SECRET_BYTES; i++)
        snprintf(secret_hex + 2 * i, 3, "%02x", s->secret[i]);
    am_buf open;
    am_buf_init(&open);
    int rc = am_buf_puts(&open, "{\"op\":\"open\",\"token\":");
    rc |= am_buf_json_string(&open, cfg->token, strlen(cfg->token));
    rc |= am_buf_printf(&open, ",\"secret\":\"%s\",\"client\":{\"name\":\"accelmig-opencl\",\"pid\":%ld},\"device\":",
                        secret_hex, (long)getpid());
    rc |= am_buf_json_string(&open, device_id, strlen(device_id));
    rc |= am_buf_puts(&open, "}");
    OPENSSL_cleanse(secret_hex, sizeof secret_hex);
    if (rc != 0) {
        am_error_set(err, "INTERNAL", "out of memory");
        goto fail;
    }
    if (dial(s, s->endpoint, s->connect_timeout, (const char *)open.data, err) != 0)
        goto fail;
    json_object *opened = next_answer(s, am_now() + s->connect_timeout, err);
    if (opened == NULL)
        goto fail;
    size_t sid_len = 0;
    const char *sid = am_json_str(opened, "sid", &sid_len);
    if (strcmp(am_json_op(opened), "redirect") == 0) {
        /* a pool of several nodes: the redirect (wire.dataplane.parse_redirect) is milestone 2 */
        am_error_set(err, "UNAVAILABLE", "the pool at %s placed the session on another node (%.100s): "
                     "redirects are not supported by this driver yet; use that node's endpoint", s->endpoint,
                     am_json_str(opened, "endpoint", NULL) ? am_json_str(opened, "endpoint", NULL) : "?");
        json_object_put(opened);
        goto fail;
    }
    if (strcmp(am_json_op(opened), "opened") != 0 || sid == NULL || sid_len == 0 || sid_len >= sizeof s->sid ||
        !am_utf8_valid(sid, sid_len) || strpbrk(sid, "\"\\") != NULL ||
        !am_json_u64(am_json_get(opened, "epoch"), &s->epoch)) {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: expected opened, got %.40s", am_json_op(opened));
        json_object_put(opened);
        goto fail;
    }
    memcpy(s->sid, sid, sid_len + 1);
    json_object_put(opened);
    s->state = ST_CONNECTED;
    if (end_handshake(s) != 0) {
        *err = s->frame_error;
        goto fail;
    }
    /* the I/O thread takes every signal's default away from nothing: they stay the application's */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int started = pthread_create(&s->thread, NULL, io_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (started != 0) {
        am_error_set(err, "INTERNAL", "cannot start the session's thread: %s", strerror(started));
        goto fail;
    }
    s->thread_started = true;
    am_buf_free(&open);
    am_info("session %s opened at %s on device %s", s->sid, s->endpoint, device_id);
    return s;
fail:
    am_buf_free(&open);
    session_free(s);
    return NULL;
}

am_session *am_session_offline(uint32_t pending) {
    am_config cfg;
    am_config_defaults(&cfg);
    am_session *s = session_new(&cfg, NULL, NULL);
    if (s == NULL)
        return NULL;
    snprintf(s->sid, sizeof s->sid, "offline");
    if (am_reader_init(&s->reader, MAX_HEADER, MAX_PAYLOAD, MAX_UNSUNK, payload_sink, s) != 0) {
        session_free(s);
        return NULL;
    }
    s->state = ST_CONNECTED;
    for (uint32_t i = 0; i < pending; i++) {
        am_cmd *cmd = am_cmd_new("read", "", NULL, 0, false);
        if (cmd == NULL || am_window_add(&s->window, cmd) != 0) {
            am_cmd_free(cmd);
            break;
        }
        if (i % 2 == 0) { /* (some with a destination for a payload) */
            cmd->sink = calloc(1, 64);
            cmd->sink_len = cmd->sink != NULL ? 64 : 0;
            cmd->payload_owned = cmd->sink; /* (freed with the command) */
        }
    }
    s->send_next = s->window.next_seq;
    return s;
}

int am_session_feed(am_session *s, const uint8_t *data, size_t len, am_error *err) {
    while (len > 0) {
        size_t space_len;
        uint8_t *space = am_reader_space(&s->reader, &space_len);
        if (space == NULL) {
            am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", s->reader.error);
            return -1;
        }
        size_t n = len < space_len ? len : space_len;
        memcpy(space, data, n);
        data += n;
        len -= n;
        int rc = am_reader_feed(&s->reader, n, on_frame, s);
        settle_batch(s);
        if (rc != 0) {
            if (s->frame_failed)
                *err = s->frame_error;
            else
                am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", s->reader.error);
            s->frame_failed = false;
            return -1;
        }
    }
    return 0;
}

uint64_t am_session_handle(am_session *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t handle = s->next_handle++;
    pthread_mutex_unlock(&s->mu);
    return handle;
}

uint64_t am_session_chunk(const am_session *s) {
    return s->chunk;
}

const char *am_session_sid(const am_session *s) {
    return s->sid;
}

int am_session_submit(am_session *s, am_cmd *cmd, uint64_t *seq, am_error *err) {
    pthread_mutex_lock(&s->mu);
    while (s->state != ST_FAILED && s->state != ST_CLOSED && !s->closing &&
           !am_window_has_room(&s->window, cmd->payload_len))
        pthread_cond_wait(&s->cond, &s->mu);
    if (s->state == ST_FAILED || s->state == ST_CLOSED || s->closing) {
        if (s->state == ST_FAILED)
            *err = s->failure;
        else
            am_error_set(err, "CLOSED", "session %s is closed", s->sid);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    if (am_window_add(&s->window, cmd) != 0) {
        pthread_mutex_unlock(&s->mu);
        am_error_set(err, "INTERNAL", "out of memory");
        return -1;
    }
    if (cmd->completes && cmd->seq > s->sync_pending_upto)
        s->sync_pending_upto = cmd->seq;
    if (seq != NULL)
        *seq = cmd->seq;
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return 0;
}

void am_session_wait(am_session *s, am_cmd *cmd) {
    pthread_mutex_lock(&s->mu);
    while (!cmd->done)
        pthread_cond_wait(&s->cond, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

uint64_t am_session_last_seq(am_session *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t seq = s->window.next_seq - 1;
    pthread_mutex_unlock(&s->mu);
    return seq;
}

void am_session_ensure_completion(am_session *s, uint64_t seq) {
    pthread_mutex_lock(&s->mu);
    bool needed = s->completed_upto < seq && s->sync_pending_upto < seq && s->state != ST_FAILED &&
                  s->state != ST_CLOSED && !s->closing;
    pthread_mutex_unlock(&s->mu);
    if (!needed)
        return;
    am_cmd *finish = am_cmd_new("finish", "", NULL, 0, false);
    am_error err;
    if (finish == NULL)
        return;
    finish->completes = true;
    if (am_session_submit(s, finish, NULL, &err) != 0)
        am_cmd_free(finish);
}

uint64_t am_session_completed(am_session *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t upto = s->completed_upto;
    pthread_mutex_unlock(&s->mu);
    return upto;
}

bool am_session_on_io_thread(const am_session *s) {
    return s != NULL && s->thread_started && pthread_equal(pthread_self(), s->thread);
}

bool am_session_failed(am_session *s, am_error *err) {
    pthread_mutex_lock(&s->mu);
    bool failed = s->state == ST_FAILED;
    if (failed && err != NULL)
        *err = s->failure;
    pthread_mutex_unlock(&s->mu);
    return failed;
}

void am_session_close(am_session *s) {
    if (s == NULL)
        return;
    /* release at the pool (its memory back at once, not after the grace) */
    am_cmd *release = s->thread_started ? am_cmd_new("release", "", NULL, 0, false) : NULL;
    am_error err;
    if (release != NULL) {
        release->waited = true;
        if (am_session_submit(s, release, NULL, &err) == 0) {
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            until.tv_sec += s->timeout < 10 ? (time_t)s->timeout : 10;
            pthread_mutex_lock(&s->mu);
            while (!release->done && s->state == ST_CONNECTED &&
                   pthread_cond_timedwait(&s->cond, &s->mu, &until) != ETIMEDOUT) {
            }
            if (release->done) {
                pthread_mutex_unlock(&s->mu);
                am_cmd_free(release);
            } else {
                release->waited = false; /* (the window frees it) */
                pthread_mutex_unlock(&s->mu);
            }
        } else {
            am_cmd_free(release);
        }
    }
    pthread_mutex_lock(&s->mu);
    s->closing = true;
    if (s->state != ST_CLOSED)
        state_to(s, ST_CLOSED);
    pthread_mutex_unlock(&s->mu);
    wake(s);
    if (s->thread_started)
        pthread_join(s->thread, NULL);
    am_info("session %s closed", s->sid);
    session_free(s);
}

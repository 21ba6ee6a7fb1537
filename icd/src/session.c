#include "session.h"

#include <errno.h>
#include <fcntl.h>
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

#include "agent.h"
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
/* reply bytes it lets pile up unacknowledged while commands are in flight:
 * the pool holds a session's next command while the replies it keeps
 * unacknowledged pass max_reply_bytes (or its tenant's quota, with its
 * other sessions'), so a run of large reads acknowledges each one as it
 * lands, not after ACK_IDLE */
#define ACK_BYTES (1u << 20)
/* what the pool counts each reply for, beside its payload (pool.sequencing.REPLY_BYTES) */
#define REPLY_OVERHEAD 512
/* s an acknowledgement may wait for a command to carry it */
#define ACK_IDLE 0.1
/* s between keepalives at the most often, whatever the pool asks (wire.dataplane.MIN_KEEPALIVE) */
#define MIN_KEEPALIVE 0.2
/* tickets of moves already made, remembered (a rehome delivered twice moves once) */
#define USED_TICKETS 8
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

/* An explicit resume, on its asker's stack: the I/O thread takes it
 * (`taken`), does it and says so (`done`); its asker waits for that. */
typedef struct resume_request {
    char endpoint[320];
    char ticket[AM_MAX_TICKET + 1];
    bool taken, done;
    int rc;
    am_error err;
    am_resume_outcome outcome;
} resume_request;

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
    char endpoint[320];        /* where the session is (mu: the agent's thread reads it) */
    char challenge[128];
    char pool_instance[40];    /* the welcome's: the pool node it lives on (binding proofs) */
    char device_id[64];
    char domain[40];           /* the domain told at open ("" none): what binding proofs are for */
    char name[64];             /* the application, for the guest agent's listing */
    char agent_socket[108];
    struct am_registration *registration;
    /* fork: every open session is on one list, for the handlers */
    am_session *next_open, *prev_open;
    bool listed;
    bool forked;               /* a fork's child's copy (see session.h) */
    bool owned_here;           /* ... that resumed in the child: the child's now */
    /* a pool of several nodes: the node that redirected the open ("" none);
     * while the session's own node does not answer, every other reconnect
     * asks it, and it says whether that node is gone or where the session is */
    char placed_by[320];
    bool ask_placer;
    char lives_at[320];        /* a refused resume's "the session lives there" ("" none) */
    /* an explicit resume (the guest agent's): asked, taken by the I/O
     * thread, answered; a refused one that may work later is retried in
     * the background there, with its ticket (`target`) */
    struct resume_request *request;
    int preempt_fd;            /* readable: an explicit resume waits, a reconnect's waits give up */
    char target[320];
    char target_ticket[AM_MAX_TICKET + 1];
    unsigned char used_tickets[USED_TICKETS][32];   /* SHA-256 of tickets that moved it */
    unsigned used_count;
    /* TLS resumption: the last connection's TLS session, offered only to the endpoint it came from */
    SSL_SESSION *tls_session;
    char tls_session_endpoint[320];
    uint64_t resumes, tls_resumes;
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
    uint64_t unacked_bytes;    /* what the pool counts the replies since acked_sent for (mu) */
    double last_send;
    double keepalive_every;    /* s of sending nothing before a keepalive (0: the pool asks for none) */
    unsigned version;          /* the protocol the pool agreed to at the last connection */
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

static double am_wall_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
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
        if (cmd != NULL)
            s->unacked_bytes += len + REPLY_OVERHEAD;
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
            s->unacked_bytes += REPLY_OVERHEAD;
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

/* A pool of several nodes: where a refused resume's session lives, if the
 * error says (checked before anything dials it). */
static void note_lives_at(am_session *s, json_object *error) {
    size_t len = 0;
    const char *home = am_json_str(am_json_get(error, "details"), "lives_at", &len);
    char host[256];
    int port;
    s->lives_at[0] = 0;
    if (home != NULL && len < sizeof s->lives_at && strlen(home) == len &&
        am_parse_endpoint(home, host, sizeof host, &port) == 0)
        memcpy(s->lives_at, home, len + 1);
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
        json_object *error = am_json_get(answer, "error");
        am_error_from_wire(err, error);
        note_lives_at(s, error);
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
    if (frame.data != NULL) /* (an open's frame holds the session's secret) */
        OPENSSL_cleanse(frame.data, frame.len);
    am_buf_free(&frame);
    return rc;
}

/* The welcome's terms (the caller still owns it): the protocol, the
 * challenge, the frame limit, the node's instance, the keepalive asked for. */
static int take_welcome(am_session *s, json_object *welcome, const char *endpoint, am_error *err) {
    uint64_t version = 0, max_payload = CHUNK;
    size_t challenge_len = 0;
    const char *challenge = am_json_str(welcome, "challenge", &challenge_len);
    json_object *limit = am_json_get(welcome, "max_payload");
    bool spoken = false;
    if (strcmp(am_json_op(welcome), "welcome") != 0 || !am_json_u64(am_json_get(welcome, "version"), &version) ||
        !(spoken = version == AM_PROTOCOL_VERSION || version == AM_PROTOCOL_OFFSET) || challenge == NULL ||
        challenge_len >= sizeof s->challenge ||
        (limit != NULL && (!am_json_u64(limit, &max_payload) || max_payload < 4096))) {
        am_error_set(err, version && !spoken ? "VERSION_UNSUPPORTED" : "PROTOCOL_ERROR",
                     "the pool at %s does not speak data-plane protocol %d (the OpenCL driver needs it: "
                     "upgrade the pool)", endpoint, AM_PROTOCOL_VERSION);
        return -1;
    }
    memcpy(s->challenge, challenge, challenge_len + 1);
    s->chunk = max_payload < CHUNK ? max_payload : CHUNK;
    s->version = (unsigned)version;
    /* the node it speaks for (binding proofs name it), checked as wire.attestation checks one */
    size_t instance_len = 0;
    const char *instance = am_json_str(welcome, "instance", &instance_len);
    pthread_mutex_lock(&s->mu);
    s->pool_instance[0] = 0;
    if (instance != NULL && instance_len >= 4 && instance_len <= 32 &&
        strspn(instance, "0123456789abcdef") == instance_len)
        memcpy(s->pool_instance, instance, instance_len + 1);
    pthread_mutex_unlock(&s->mu);
    /* wire.dataplane.keepalive_interval: a third of the idle_timeout it announces */
    json_object *idle = am_json_get(welcome, "idle_timeout");
    double idle_s = 0;
    if (idle != NULL && (json_object_get_type(idle) == json_type_int || json_object_get_type(idle) == json_type_double))
        idle_s = json_object_get_double(idle);
    s->keepalive_every = idle_s > 0 && idle_s < 1e9 ? (idle_s / 3 > MIN_KEEPALIVE ? idle_s / 3 : MIN_KEEPALIVE) : 0;
    return 0;
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
    SSL_SESSION *offer = s->tls_session != NULL && strcmp(s->tls_session_endpoint, endpoint) == 0 ? s->tls_session
                                                                                                  : NULL;
    if (am_link_dial(&s->link, s->tls, endpoint, timeout, offer, s->preempt_fd, err) != 0)
        return -1;
    if (offer != NULL && !s->link.tls_resumed)
        am_info("the pool at %s did not resume the TLS session: a full handshake", endpoint);
    s->capture = true;
    char hello[64];
    snprintf(hello, sizeof hello, "{\"op\":\"hello\",\"versions\":[%d,%d]}", AM_PROTOCOL_VERSION,
             AM_PROTOCOL_OFFSET);
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
    int taken = take_welcome(s, welcome, endpoint, err);
    json_object_put(welcome);
    if (taken != 0)
        goto fail;
    /* (under TLS 1.3 the pool's ticket came ahead of the welcome: read now, it is in) */
    SSL_SESSION *kept = am_link_tls_session(&s->link);
    if (kept != NULL) {
        if (s->tls_session != NULL)
            SSL_SESSION_free(s->tls_session);
        s->tls_session = kept;
        snprintf(s->tls_session_endpoint, sizeof s->tls_session_endpoint, "%s", endpoint);
    }
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
    probe.preempt_fd = -1;
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
    if (probe.tls_session != NULL)
        SSL_SESSION_free(probe.tls_session);
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
        if (s->window.last_seen > s->acked_sent) {
            s->acked_sent = s->window.last_seen;
            s->unacked_bytes = 0;
        }
        s->send_next++;
    }
    if (s->big == NULL && s->out.len == 0) {
        /* An ack frame: when replies piled up (by count, or by bytes while
         * commands wait behind them at the pool), after ACK_IDLE of sending
         * nothing, and as the keepalive the welcome asked for (acknowledging
         * again what was acknowledged is a no-op for every pool). */
        double now = am_now();
        uint64_t unacked = s->window.last_seen - s->acked_sent;
        bool due = unacked > 0 && (unacked >= ACK_EVERY || now - s->last_send >= ACK_IDLE ||
                                   (s->unacked_bytes >= ACK_BYTES && s->window.count > 0));
        if (due || (s->keepalive_every > 0 && now - s->last_send >= s->keepalive_every)) {
            char ack[64];
            int n = snprintf(ack, sizeof ack, "{\"op\":\"ack\",\"ack\":%" PRIu64 "}", s->window.last_seen);
            if (n < 0 || am_frame_head(&s->out, ack, (size_t)n, 0) != 0)
                return -1;
            if (!due)
                am_debug("session %s: keepalive after %.1f s of sending nothing", s->sid, now - s->last_send);
            s->acked_sent = s->window.last_seen;
            s->unacked_bytes = 0;
        }
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

/* One resume attempt (I/O thread) at `endpoint`, with a migration's
 * `ticket` ("" none): 0 (connected; `out` says how, if given), -1 (err;
 * terminal or not; `s->lives_at` names the node a pool of several says
 * the session lives on). */
static int try_resume(am_session *s, const char *endpoint, const char *ticket, double timeout,
                      am_resume_outcome *out, am_error *err) {
    pthread_mutex_lock(&s->mu);
    if (s->state != ST_DISCONNECTED) {
        if (s->state == ST_FAILED)
            *err = s->failure;
        else
            am_error_set(err, "CLOSED", "session %s is closed", s->sid);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    state_to(s, ST_RESUMING);
    uint64_t last_seen = s->window.last_seen, next_seq = s->window.next_seq, epoch = s->epoch;
    pthread_mutex_unlock(&s->mu);
    am_resume_outcome outcome = {.ticket = ticket[0] != 0, .asked = am_wall_clock()};
    s->lives_at[0] = 0;
    double started = am_now();
    am_buf request;
    am_buf_init(&request);
    if (dial(s, endpoint, timeout, NULL, err) != 0)
        goto fail;
    outcome.connected = am_wall_clock();
    char proof[65];
    am_ownership_proof(s->secret, sizeof s->secret, s->challenge, s->sid, epoch, s->link.binding,
                       s->link.binding_len, proof);
    int rc = am_buf_printf(&request, "{\"op\":\"resume\",\"sid\":\"%s\",\"epoch\":%" PRIu64 ",\"last_seen\":%" PRIu64
                           ",\"next_seq\":%" PRIu64 ",\"proof\":\"%s\"", s->sid, epoch, last_seen, next_seq, proof);
    if (ticket[0] != 0) {
        rc |= am_buf_puts(&request, ",\"ticket\":");
        rc |= am_buf_json_string(&request, ticket, strlen(ticket));
    }
    rc |= am_buf_puts(&request, "}");
    if (rc != 0) {
        am_error_set(err, "INTERNAL", "out of memory");
        goto fail_link;
    }
    double deadline = am_now() + timeout;
    if (send_frame(s, (const char *)request.data, deadline, err) != 0)
        goto fail_link;
    json_object *answer = next_answer(s, deadline, err);
    if (answer == NULL)
        goto fail_link;
    uint64_t new_epoch, expect, replayed = 0;
    if (strcmp(am_json_op(answer), "resumed") != 0 || !am_json_u64(am_json_get(answer, "epoch"), &new_epoch) ||
        !am_json_u64(am_json_get(answer, "expect"), &expect) || expect > next_seq || expect == 0) {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: an odd answer to a resume");
        json_object_put(answer);
        goto fail_link;
    }
    am_json_u64(am_json_get(answer, "replay"), &replayed);
    json_object_put(answer);
    am_buf_free(&request);
    outcome.answered = am_wall_clock();
    pthread_mutex_lock(&s->mu);
    if (s->state != ST_RESUMING) { /* (closed meanwhile: the connection goes with it) */
        pthread_mutex_unlock(&s->mu);
        am_error_set(err, "CLOSED", "session %s is closed", s->sid);
        goto fail_link;
    }
    s->epoch = new_epoch;
    snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    s->send_next = expect;           /* re-send exactly what the pool lacks */
    s->acked_sent = last_seen;
    s->unacked_bytes = 0;
    s->resumes++;
    if (s->link.tls_resumed)
        s->tls_resumes++;
    if (s->forked)
        s->owned_here = true; /* (the pool took this copy: it is the child's now) */
    reset_stream(s);
    s->last_send = am_now();
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
    outcome.epoch = new_epoch;
    outcome.replayed = replayed;
    outcome.resent = next_seq - expect;
    outcome.seconds = am_now() - started;
    outcome.tls_resumed = s->link.tls_resumed;
    snprintf(outcome.endpoint, sizeof outcome.endpoint, "%s", endpoint);
    if (out != NULL)
        *out = outcome;
    am_info("session %s resumed at %s: epoch %" PRIu64 ", %" PRIu64 " replayed, re-sending from %" PRIu64
            ", %.1f ms%s%s", s->sid, endpoint, new_epoch, replayed, expect, outcome.seconds * 1000,
            outcome.ticket ? " (a migration's ticket)" : "", s->link.tls_resumed ? " (TLS session resumed)" : "");
    return 0;
fail_link:
    am_link_close(&s->link);
fail:
    am_buf_free(&request);
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

/* -- fork ------------------------------------------------------------------------------- */

static pthread_mutex_t open_mu = PTHREAD_MUTEX_INITIALIZER;
static am_session *open_sessions;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) {
    pthread_mutex_lock(&open_mu);
    for (am_session *s = open_sessions; s != NULL; s = s->next_open) {
        if (s->hooks.fork != NULL)
            s->hooks.fork(s->hooks.ctx, AM_FORK_PREPARE);
        pthread_mutex_lock(&s->mu);
    }
}

static void fork_parent(void) {
    for (am_session *s = open_sessions; s != NULL; s = s->next_open) {
        pthread_mutex_unlock(&s->mu);
        if (s->hooks.fork != NULL)
            s->hooks.fork(s->hooks.ctx, AM_FORK_PARENT);
    }
    pthread_mutex_unlock(&open_mu);
}

/* The child's copy of `s` (mu held, the only thread): no thread, no
 * connection, nothing sent until a command needs the device. */
static void become_copy(am_session *s) {
    if (s->link.fd >= 0)
        close(s->link.fd); /* (never shutdown: the parent's connection is the same one) */
    /* its TLS objects are left as they are: a thread of the parent may have
     * been inside them, and freeing them could touch what it held */
    memset(&s->link, 0, sizeof s->link);
    s->link.fd = -1;
    /* eventfds are shared with the parent across a fork: new ones */
    close(s->wake_fd);
    close(s->preempt_fd);
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->preempt_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->thread_started = false;
    s->registration = NULL; /* (the parent's: its thread is not here) */
    s->request = NULL;
    s->capture = false;
    s->out.len = s->out_pos = 0;
    s->big = NULL;
    s->out_want = 0;
    s->forked = true;
    if (s->state == ST_CONNECTED || s->state == ST_RESUMING) {
        s->state = ST_DISCONNECTED;
        s->disconnected_since = am_now();
        am_error_set(&s->last_error, "DISCONNECTED", "a fork's copy of the session");
    }
}

static void fork_child(void) {
    for (am_session *s = open_sessions; s != NULL; s = s->next_open) {
        become_copy(s);
        pthread_mutex_unlock(&s->mu);
        if (s->hooks.fork != NULL)
            s->hooks.fork(s->hooks.ctx, AM_FORK_CHILD);
    }
    pthread_mutex_unlock(&open_mu);
}

static void register_fork_handlers(void) {
    if (pthread_atfork(fork_prepare, fork_parent, fork_child) != 0)
        am_warn("fork: no handlers: a child of this process must not use its parent's OpenCL objects");
}

static void list_open(am_session *s) {
    pthread_once(&fork_once, register_fork_handlers);
    pthread_mutex_lock(&open_mu);
    s->next_open = open_sessions;
    s->prev_open = NULL;
    if (open_sessions != NULL)
        open_sessions->prev_open = s;
    open_sessions = s;
    s->listed = true;
    pthread_mutex_unlock(&open_mu);
}

static void unlist_open(am_session *s) {
    pthread_mutex_lock(&open_mu);
    if (s->listed) {
        if (s->prev_open != NULL)
            s->prev_open->next_open = s->next_open;
        else
            open_sessions = s->next_open;
        if (s->next_open != NULL)
            s->next_open->prev_open = s->prev_open;
        s->listed = false;
    }
    pthread_mutex_unlock(&open_mu);
}

static void *io_main(void *arg);

/* The I/O thread (mu held): at the open, and in a fork's child at its first command. */
static int start_thread(am_session *s) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* (signals stay the application's) */
    int started = pthread_create(&s->thread, NULL, io_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (started == 0)
        s->thread_started = true;
    return started;
}

static void drain(int fd) {
    uint64_t count;
    while (read(fd, &count, sizeof count) > 0) {
    }
}

static void drain_wake(am_session *s) {
    drain(s->wake_fd);
}

static bool retriable(const am_error *err) {
    static const char *const codes[] = {"TICKET_REQUIRED", "WRONG_HOST", "UNAVAILABLE", "DISCONNECTED", "TIMEOUT"};
    for (size_t i = 0; i < sizeof codes / sizeof *codes; i++)
        if (strcmp(err->code, codes[i]) == 0)
            return true;
    return false;
}

/* the SHA-256 of a ticket: what is remembered of tickets that moved the session */
static void ticket_digest(const char *ticket, unsigned char out[32]) {
    unsigned int len = 32;
    EVP_Digest(ticket, strlen(ticket), out, &len, EVP_sha256(), NULL);
}

static bool ticket_used(am_session *s, const char *ticket) {
    unsigned char digest[32];
    ticket_digest(ticket, digest);
    unsigned count = s->used_count < USED_TICKETS ? s->used_count : USED_TICKETS;
    for (unsigned i = 0; i < count; i++)
        if (CRYPTO_memcmp(s->used_tickets[i], digest, 32) == 0)
            return true;
    return false;
}

/* The guest agent's resume (I/O thread): the current connection is
 * dropped, the session resumes where it is told, once more where a pool of
 * several nodes says it lives; a refusal that may pass (the move is not
 * ready, the path not up yet) leaves that target to the reconnects. */
static void do_request(am_session *s, resume_request *req) {
    pthread_mutex_lock(&s->mu);
    bool connected = s->state == ST_CONNECTED;
    if (connected) {
        state_to(s, ST_DISCONNECTED);
        s->disconnected_since = am_now();
        am_error_set(&s->last_error, "DISCONNECTED", "resuming at %s, as the guest agent asked", req->endpoint);
    }
    pthread_mutex_unlock(&s->mu);
    if (connected) {
        am_link_close(&s->link);
        reset_stream(s);
    }
    am_info("session %s: resuming at %s%s, as the guest agent asks", s->sid, req->endpoint,
            req->ticket[0] ? " with a migration's ticket" : "");
    am_error err = {0};
    int rc = try_resume(s, req->endpoint, req->ticket, s->connect_timeout, &req->outcome, &err);
    if (rc != 0 && !am_error_terminal(&err) && strcmp(err.code, "UNAVAILABLE") == 0 && s->lives_at[0] != 0 &&
        strcmp(s->lives_at, req->endpoint) != 0) {
        char home[sizeof s->lives_at];
        memcpy(home, s->lives_at, sizeof home);
        am_info("session %s lives on another node, at %s: resuming there", s->sid, home);
        snprintf(req->endpoint, sizeof req->endpoint, "%s", home);
        rc = try_resume(s, req->endpoint, req->ticket, s->connect_timeout, &req->outcome, &err);
    }
    pthread_mutex_lock(&s->mu);
    if (rc == 0) {
        s->target[0] = 0;
        s->target_ticket[0] = 0;
        if (req->ticket[0] != 0)
            ticket_digest(req->ticket, s->used_tickets[s->used_count++ % USED_TICKETS]);
    } else if (!am_error_terminal(&err) && (retriable(&err) || strcmp(err.code, "PROTOCOL_ERROR") == 0)) {
        /* (the answer may have been lost, or the path not be up yet: keep trying there) */
        snprintf(s->target, sizeof s->target, "%s", req->endpoint);
        snprintf(s->target_ticket, sizeof s->target_ticket, "%s", req->ticket);
    }
    req->rc = rc;
    req->err = err;
    req->done = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
}

/* The request an explicit resume left, now the I/O thread's (NULL: none). */
static resume_request *take_request(am_session *s) {
    pthread_mutex_lock(&s->mu);
    resume_request *req = s->request;
    if (req != NULL) {
        s->request = NULL;
        req->taken = true;
    }
    pthread_mutex_unlock(&s->mu);
    if (req != NULL)
        drain(s->preempt_fd);
    return req;
}

/* Where a reconnect goes: an explicit resume's target, else where the
 * session is, every other time the node that placed it while that one
 * does not answer (it says where the session is, or that it is gone). */
static const char *reconnect_endpoint(am_session *s, const char **ticket) {
    *ticket = "";
    if (s->target[0] != 0) {
        *ticket = s->target_ticket;
        return s->target;
    }
    if (s->placed_by[0] == 0 || strcmp(s->placed_by, s->endpoint) == 0)
        return s->endpoint;
    s->ask_placer = !s->ask_placer;
    return s->ask_placer ? s->placed_by : s->endpoint;
}

static void *io_main(void *arg) {
    am_session *s = arg;
    double backoff = BACKOFF_FIRST;
    for (;;) {
        resume_request *req = take_request(s);
        if (req != NULL) {
            do_request(s, req);
            backoff = BACKOFF_FIRST;
            continue;
        }
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
            struct pollfd pfds[2] = {{.fd = s->wake_fd, .events = POLLIN}, {.fd = s->preempt_fd, .events = POLLIN}};
            poll(pfds, 2, (int)(backoff * 1000));
            drain_wake(s);
            pthread_mutex_lock(&s->mu);
            closing = s->closing;
            bool asked = s->request != NULL;
            pthread_mutex_unlock(&s->mu);
            if (closing)
                break;
            if (asked)
                continue;
            const char *ticket;
            pthread_mutex_lock(&s->mu);
            char endpoint[320];
            snprintf(endpoint, sizeof endpoint, "%s", reconnect_endpoint(s, &ticket));
            char with[AM_MAX_TICKET + 1];
            snprintf(with, sizeof with, "%s", ticket);
            pthread_mutex_unlock(&s->mu);
            double timeout = s->connect_timeout < 2.0 ? s->connect_timeout : 2.0;
            if (try_resume(s, endpoint, with, timeout, NULL, &err) == 0) {
                backoff = BACKOFF_FIRST;
                pthread_mutex_lock(&s->mu);
                if (with[0] != 0 && strcmp(s->target, endpoint) == 0) {
                    ticket_digest(with, s->used_tickets[s->used_count++ % USED_TICKETS]);
                    s->target[0] = 0;
                    s->target_ticket[0] = 0;
                }
                pthread_mutex_unlock(&s->mu);
            } else {
                am_debug("session %s: reconnect to %s failed: %s: %s", s->sid, endpoint, err.code, err.message);
                backoff = backoff * 2 > BACKOFF_LONGEST ? BACKOFF_LONGEST : backoff * 2;
            }
            continue;
        }
        if (flush_writes(s, &err) != 0) {
            link_lost(s, &err);
            continue;
        }
        struct pollfd pfds[3] = {{.fd = s->link.fd, .events = (short)(POLLIN | (s->out_want == POLLOUT ? POLLOUT : 0))},
                                 {.fd = s->wake_fd, .events = POLLIN},
                                 {.fd = s->preempt_fd, .events = POLLIN}};
        pthread_mutex_lock(&s->mu);
        bool ack_due = s->window.last_seen > s->acked_sent;
        pthread_mutex_unlock(&s->mu);
        int wait_ms = am_link_buffered(&s->link) ? 0 : ack_due ? (int)(ACK_IDLE * 1000) : 1000;
        if (s->keepalive_every > 0 && s->out_want == 0) {
            double due = (s->last_send + s->keepalive_every - am_now()) * 1000;
            int due_ms = due < 1 ? 1 : due > 1000 ? 1000 : (int)due;
            if (due_ms < wait_ms)
                wait_ms = due_ms;
        }
        int ready = poll(pfds, 3, wait_ms);
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
    /* an explicit resume asked while the session ended: answered, its asker waits */
    resume_request *left = take_request(s);
    if (left != NULL) {
        pthread_mutex_lock(&s->mu);
        left->rc = -1;
        if (s->state == ST_FAILED)
            left->err = s->failure;
        else
            am_error_set(&left->err, "CLOSED", "session %s is closed", s->sid);
        left->done = true;
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

/* -- the application's side --------------------------------------------------------- */

static am_session *session_new(const am_config *cfg, SSL_CTX *tls, const am_session_hooks *hooks) {
    am_session *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->link.fd = -1;
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->preempt_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->wake_fd < 0 || s->preempt_fd < 0 ||
        am_window_init(&s->window, cfg->window_commands, cfg->window_bytes) != 0 ||
        getrandom(s->secret, sizeof s->secret, 0) != (ssize_t)sizeof s->secret) {
        if (s->wake_fd >= 0)
            close(s->wake_fd);
        if (s->preempt_fd >= 0)
            close(s->preempt_fd);
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
    close(s->preempt_fd);
    if (s->tls_session != NULL)
        SSL_SESSION_free(s->tls_session);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->mu);
    OPENSSL_cleanse(s->secret, sizeof s->secret);
    free(s);
}

/* A pool node as a redirect names it (wire.dataplane.placement_claim's rules). */
typedef struct node_ref {
    char node[64];
    char instance[33];
    char endpoint[320];
} node_ref;

static bool node_name_ok(const char *name, size_t len) {
    if (len == 0 || len > 63 || strlen(name) != len)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                  (i > 0 && (c == '.' || c == '-'));
        if (!ok)
            return false;
    }
    return true;
}

/* wire.dataplane.parse_redirect: checked before anything dials it */
static int parse_redirect(json_object *answer, node_ref *out) {
    size_t node_len = 0, instance_len = 0, endpoint_len = 0;
    const char *node = am_json_str(answer, "node", &node_len);
    const char *instance = am_json_str(answer, "instance", &instance_len);
    const char *endpoint = am_json_str(answer, "endpoint", &endpoint_len);
    char host[256];
    int port;
    if (node == NULL || !node_name_ok(node, node_len) || instance == NULL || instance_len < 4 || instance_len > 32 ||
        strspn(instance, "0123456789abcdef") != instance_len || endpoint == NULL || endpoint_len > AM_MAX_ENDPOINT ||
        strlen(endpoint) != endpoint_len || am_parse_endpoint(endpoint, host, sizeof host, &port) != 0)
        return -1;
    memcpy(out->node, node, node_len + 1);
    memcpy(out->instance, instance, instance_len + 1);
    memcpy(out->endpoint, endpoint, endpoint_len + 1);
    return 0;
}

static int open_frame(am_session *s, const am_config *cfg, const node_ref *placed, const node_ref *unreachable,
                      am_buf *open) {
    char secret_hex[2 * SECRET_BYTES + 1];
    for (size_t i = 0; i < SECRET_BYTES; i++)
        snprintf(secret_hex + 2 * i, 3, "%02x", s->secret[i]);
    am_buf_init(open);
    int rc = am_buf_puts(open, "{\"op\":\"open\",\"token\":");
    rc |= am_buf_json_string(open, cfg->token, strlen(cfg->token));
    rc |= am_buf_printf(open, ",\"secret\":\"%s\",\"client\":{\"name\":", secret_hex);
    rc |= am_buf_json_string(open, s->name, strlen(s->name));
    rc |= am_buf_printf(open, ",\"pid\":%ld},\"device\":", (long)getpid());
    rc |= am_buf_json_string(open, s->device_id, strlen(s->device_id));
    if (s->domain[0] != 0) /* (checked: a UUID) */
        rc |= am_buf_printf(open, ",\"domain\":\"%s\"", s->domain);
    const node_ref *node = placed != NULL ? placed : unreachable;
    if (node != NULL) /* (names and instances checked: no quoting needed) */
        rc |= am_buf_printf(open, ",\"%s\":{\"node\":\"%s\",\"instance\":\"%s\"}",
                            placed != NULL ? "placed" : "unreachable", node->node, node->instance);
    rc |= am_buf_puts(open, "}");
    OPENSSL_cleanse(secret_hex, sizeof secret_hex);
    return rc;
}

/* Open at s->endpoint, the answer (its link up) or NULL (err, its link
 * closed).  A pool of several nodes may redirect the open to another node:
 * it goes there, once, naming that node (`placed`); a node that does not
 * answer (killed less than its lease's TTL ago, still listed live) is left
 * to the node that redirected, once, which places the open again without
 * it (`unreachable`). */
static json_object *open_at(am_session *s, const am_config *cfg, const node_ref *placed,
                            const node_ref *unreachable, am_error *err) {
    am_buf open;
    if (open_frame(s, cfg, placed, unreachable, &open) != 0) {
        am_buf_free(&open);
        am_error_set(err, "INTERNAL", "out of memory");
        return NULL;
    }
    int rc = dial(s, s->endpoint, s->connect_timeout, (const char *)open.data, err);
    OPENSSL_cleanse(open.data, open.len);
    am_buf_free(&open);
    json_object *answer = rc == 0 ? next_answer(s, am_now() + s->connect_timeout, err) : NULL;
    if (answer == NULL || strcmp(am_json_op(answer), "redirect") != 0) {
        if (answer == NULL) {
            am_link_close(&s->link);
            s->capture = false;
            drop_early(s);
        }
        return answer;
    }
    am_link_close(&s->link);
    s->capture = false;
    drop_early(s);
    node_ref target;
    if (placed != NULL || parse_redirect(answer, &target) != 0) {
        am_error_set(err, "PROTOCOL_ERROR", placed != NULL ? "protocol error: redirected again by %s: a session is "
                     "placed once" : "protocol error: %s answered the open with a redirect that names no node",
                     s->endpoint);
        json_object_put(answer);
        return NULL;
    }
    json_object_put(answer);
    char placer[sizeof s->endpoint];
    memcpy(placer, s->endpoint, sizeof placer);
    am_info("the open at %s was placed on node %s (instance %s): opening at %s", placer, target.node,
            target.instance, target.endpoint);
    snprintf(s->placed_by, sizeof s->placed_by, "%s", placer);
    snprintf(s->endpoint, sizeof s->endpoint, "%s", target.endpoint);
    answer = open_at(s, cfg, &target, NULL, err);
    if (answer == NULL && unreachable == NULL && strcmp(err->code, "UNAVAILABLE") == 0) {
        am_warn("could not open at node %s (%s): asking %s to place the open again", target.node, err->message,
                placer);
        snprintf(s->endpoint, sizeof s->endpoint, "%s", placer);
        s->placed_by[0] = 0;
        answer = open_at(s, cfg, NULL, &target, err);
    }
    return answer;
}

/* This process's name, for the guest agent's listing and the pool's. */
static void process_name(char *out, size_t size) {
    snprintf(out, size, "pid%ld", (long)getpid());
    int fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    char comm[32];
    ssize_t n = read(fd, comm, sizeof comm - 1);
    close(fd);
    while (n > 0 && (comm[n - 1] == '\n' || comm[n - 1] == 0))
        n--;
    if (n <= 0)
        return;
    comm[n] = 0;
    for (ssize_t i = 0; i < n; i++)
        if ((unsigned char)comm[i] < 0x20 || (unsigned char)comm[i] >= 0x7f || comm[i] == '"' || comm[i] == '\\')
            comm[i] = '_';
    snprintf(out, size, "%s", comm);
}

am_session *am_session_open(const am_config *cfg, SSL_CTX *tls, const char *device_id,
                            const am_session_hooks *hooks, am_error *err) {
    am_session *s = session_new(cfg, tls, hooks);
    if (s == NULL) {
        am_error_set(err, "INTERNAL", "out of memory");
        return NULL;
    }
    snprintf(s->device_id, sizeof s->device_id, "%s", device_id);
    snprintf(s->domain, sizeof s->domain, "%s", cfg->domain);
    snprintf(s->agent_socket, sizeof s->agent_socket, "%s", cfg->agent_socket);
    process_name(s->name, sizeof s->name);
    json_object *opened = open_at(s, cfg, NULL, NULL, err);
    if (opened == NULL)
        goto fail;
    size_t sid_len = 0;
    const char *sid = am_json_str(opened, "sid", &sid_len);
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
    s->last_send = am_now();
    if (end_handshake(s) != 0) {
        *err = s->frame_error;
        goto fail;
    }
    int started = start_thread(s);
    if (started != 0) {
        am_error_set(err, "INTERNAL", "cannot start the session's thread: %s", strerror(started));
        goto fail;
    }
    list_open(s);
    am_info("session %s opened at %s on device %s%s%s", s->sid, s->endpoint, device_id,
            s->placed_by[0] ? ", placed there by " : "", s->placed_by);
    /* registered with the guest agent (if one runs here): it hands the
     * session its tickets after a migration and asks for its binding proofs */
    s->registration = am_registration_start(s, s->agent_socket);
    return s;
fail:
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
    snprintf(s->domain, sizeof s->domain, "0f0e0d0c-0b0a-4908-8706-050403020100");
    snprintf(s->pool_instance, sizeof s->pool_instance, "0123abcd");
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

int am_session_resume(am_session *s, const char *endpoint, const char *ticket, am_resume_outcome *out,
                      am_error *err) {
    char host[256];
    int port;
    if (endpoint != NULL && endpoint[0] != 0 &&
        (strlen(endpoint) > AM_MAX_ENDPOINT || am_parse_endpoint(endpoint, host, sizeof host, &port) != 0)) {
        am_error_set(err, "BAD_REQUEST", "invalid request: resume: endpoint %.80s is not HOST:PORT", endpoint);
        return -1;
    }
    if (ticket != NULL && strlen(ticket) > AM_MAX_TICKET) {
        am_error_set(err, "BAD_REQUEST", "invalid request: resume: a ticket of over %d characters", AM_MAX_TICKET);
        return -1;
    }
    resume_request req;
    memset(&req, 0, sizeof req);
    pthread_mutex_lock(&s->mu);
    snprintf(req.endpoint, sizeof req.endpoint, "%s", endpoint != NULL && endpoint[0] != 0 ? endpoint : s->endpoint);
    snprintf(req.ticket, sizeof req.ticket, "%s", ticket != NULL ? ticket : "");
    if (req.ticket[0] != 0 && ticket_used(s, req.ticket)) {
        /* this move happened already (the rehome was delivered twice, or a
         * reconnect made it): where it went, it is */
        if (s->state == ST_CONNECTED && strcmp(req.endpoint, s->endpoint) == 0) {
            memset(out, 0, sizeof *out);
            out->epoch = s->epoch;
            out->ticket = out->already = true;
            snprintf(out->endpoint, sizeof out->endpoint, "%s", s->endpoint);
            pthread_mutex_unlock(&s->mu);
            return 0;
        }
        req.ticket[0] = 0;
    }
    /* one explicit resume at a time (the agent asks one after the other) */
    while (s->request != NULL && s->state != ST_FAILED && s->state != ST_CLOSED && !s->closing)
        pthread_cond_wait(&s->cond, &s->mu);
    if (s->state == ST_FAILED || s->state == ST_CLOSED || s->closing || !s->thread_started) {
        if (s->state == ST_FAILED)
            *err = s->failure;
        else
            am_error_set(err, "CLOSED", "session %s is closed", s->sid);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    s->request = &req;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    ssize_t n = write(s->preempt_fd, &one, sizeof one); /* (a reconnect in the way gives up) */
    (void)n;
    /* the I/O thread answers every request it took, and takes every one
     * before it ends (bounded: each of its attempts has its deadline) */
    pthread_mutex_lock(&s->mu);
    while (!req.done)
        pthread_cond_wait(&s->cond, &s->mu);
    pthread_mutex_unlock(&s->mu);
    if (req.rc != 0) {
        *err = req.err;
        return -1;
    }
    *out = req.outcome;
    return 0;
}

void am_bind_proof(const unsigned char *secret, size_t secret_len, const char *instance, const char *challenge,
                   const char *host, const char *domain, const char *sid, char out[65]) {
    am_buf msg;
    am_buf_init(&msg);
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int mac_len = 0;
    out[0] = 0;
    if (am_buf_printf(&msg, "accelmig-bind-1|%s|%s|%s|%s|%s", instance, challenge, host, domain, sid) != 0 ||
        HMAC(EVP_sha256(), secret, (int)secret_len, msg.data, msg.len, mac, &mac_len) == NULL || mac_len != 32) {
        am_buf_free(&msg);
        return;
    }
    am_buf_free(&msg);
    static const char hex[] = "0123456789abcdef";
    for (unsigned i = 0; i < 32; i++) {
        out[2 * i] = hex[mac[i] >> 4];
        out[2 * i + 1] = hex[mac[i] & 15];
    }
    out[64] = 0;
}

int am_session_bind_proof(am_session *s, const char *host, json_object *challenges, char proof[65],
                          char domain[40], am_error *err) {
    char instance[sizeof s->pool_instance];
    pthread_mutex_lock(&s->mu);
    memcpy(instance, s->pool_instance, sizeof instance);
    pthread_mutex_unlock(&s->mu);
    /* the domain this driver itself reads (SMBIOS, or the agent's word for
     * it), never one the asker names: a host proves only the guest it runs */
    if (s->domain[0] == 0 && s->agent_socket[0] != 0)
        am_agent_domain(s->agent_socket, s->domain, sizeof s->domain);
    if (s->domain[0] == 0) {
        am_error_set(err, "CONFLICT", "conflict: session %s: this guest has no SMBIOS system UUID, so the driver "
                     "cannot say which domain it proves the session for", s->sid);
        return -1;
    }
    const char *challenge = instance[0] != 0 ? am_json_str(challenges, instance, NULL) : NULL;
    if (challenge == NULL) {
        am_error_set(err, "CONFLICT", "conflict: session %s: no challenge of its pool instance %s (a node it does "
                     "not live on asked)", s->sid, instance[0] ? instance : "(unknown)");
        return -1;
    }
    am_bind_proof(s->secret, sizeof s->secret, instance, challenge, host, s->domain, s->sid, proof);
    if (proof[0] == 0) {
        am_error_set(err, "INTERNAL", "internal error: HMAC-SHA256 failed");
        return -1;
    }
    snprintf(domain, 40, "%s", s->domain);
    return 0;
}

unsigned am_session_version(am_session *s) {
    return s->version;
}

uint64_t am_session_epoch(am_session *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t epoch = s->epoch;
    pthread_mutex_unlock(&s->mu);
    return epoch;
}

void am_session_endpoint(am_session *s, char *out, size_t size) {
    pthread_mutex_lock(&s->mu);
    snprintf(out, size, "%s", s->endpoint);
    pthread_mutex_unlock(&s->mu);
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

const char *am_session_name(const am_session *s) {
    return s->name;
}

int am_session_check_answer(am_session *s, const uint8_t *text, size_t len, am_error *err) {
    char why[128];
    json_object *answer = am_json_parse_header((const char *)text, len, why, sizeof why);
    if (answer == NULL) {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: %s", why);
        return -1;
    }
    const char *op = am_json_op(answer);
    int rc = 0;
    if (strcmp(op, "welcome") == 0) {
        rc = take_welcome(s, answer, "fuzz:1", err);
    } else if (strcmp(op, "redirect") == 0) {
        node_ref target;
        rc = parse_redirect(answer, &target);
        if (rc != 0)
            am_error_set(err, "PROTOCOL_ERROR", "protocol error: a redirect that names no node");
    } else if (strcmp(op, "error") == 0) {
        am_error_from_wire(err, am_json_get(answer, "error"));
        note_lives_at(s, am_json_get(answer, "error"));
        rc = -1;
    } else {
        am_error_set(err, "PROTOCOL_ERROR", "protocol error: not a handshake's answer");
        rc = -1;
    }
    json_object_put(answer);
    return rc;
}

/* A fork's child that only lets objects go sends nothing: they are the parent's too. */
static bool stays_local(const am_session *s, const am_cmd *cmd) {
    return s->forked && !s->owned_here &&
           (strcmp(cmd->op, "free") == 0 || strcmp(cmd->op, "free_program") == 0 || strcmp(cmd->op, "release") == 0);
}

int am_session_submit(am_session *s, am_cmd *cmd, uint64_t *seq, am_error *err) {
    pthread_mutex_lock(&s->mu);
    if (stays_local(s, cmd)) {
        pthread_mutex_unlock(&s->mu);
        if (seq != NULL)
            *seq = 0;
        cmd->ok = true;
        if (cmd->on_reply != NULL)
            cmd->on_reply(cmd, cmd->hook_ctx);
        if (cmd->waited)
            cmd->done = true;
        else
            am_cmd_free(cmd);
        return 0;
    }
    if (s->forked && !s->thread_started && s->state == ST_DISCONNECTED && !s->closing) {
        /* the child's first command: its copy of the session resumes (the pool decides) */
        s->disconnected_since = am_now();
        int started = start_thread(s);
        if (started != 0) {
            pthread_mutex_unlock(&s->mu);
            am_error_set(err, "INTERNAL", "cannot start the session's thread: %s", strerror(started));
            return -1;
        }
        am_info("session %s: a fork's copy, used in the child (pid %ld): resuming it", s->sid, (long)getpid());
    }
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
    unlist_open(s);
    /* unregistered first: the agent asks nothing of a session that goes */
    am_registration_stop(s->registration);
    s->registration = NULL;
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

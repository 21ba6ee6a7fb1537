#include "agent.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "link.h"
#include "log.h"

/* s: the wait before registering again once the agent went away */
#define RETRY 1.0
/* s: while no agent socket exists, the wait between looks, first and longest */
#define ABSENT_FIRST 1.0
#define ABSENT_LONGEST 30.0
/* s: how long a start waits for the agent to take the registration */
#define REGISTER_WAIT 2.0
/* s: how long a line to the agent may take to go (an agent that does not read is dropped) */
#define SEND_TIMEOUT 5.0
/* wire.attestation: the instances one prove names at most, a challenge's digits */
#define MAX_INSTANCES 128

struct am_registration {
    am_session *session;
    char path[108];
    int stop_fd;                 /* readable: stop */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    bool registered;             /* (mu) the agent took the registration */
    int fd;                      /* the thread's connection to the agent (-1: none) */
    am_lines lines;
    int64_t next_id;
};

/* -- lines ----------------------------------------------------------------------------- */

void am_lines_init(am_lines *lines) {
    memset(lines, 0, sizeof *lines);
}

void am_lines_free(am_lines *lines) {
    free(lines->buf);
    memset(lines, 0, sizeof *lines);
}

static int lines_keep(am_lines *lines, const char *data, size_t len) {
    if (len == 0)
        return 0;
    if (lines->len + len > AM_AGENT_MAX_LINE) {
        lines->len = 0;
        lines->skipping = true; /* (up to its newline) */
        lines->dropped++;
        am_warn("the guest agent sent a line of over %d bytes: dropped", AM_AGENT_MAX_LINE);
        return 0;
    }
    if (lines->len + len > lines->cap) {
        size_t cap = lines->cap ? lines->cap : 4096;
        while (cap < lines->len + len)
            cap *= 2;
        char *bigger = realloc(lines->buf, cap);
        if (bigger == NULL)
            return -1;
        lines->buf = bigger;
        lines->cap = cap;
    }
    memcpy(lines->buf + lines->len, data, len);
    lines->len += len;
    return 0;
}

void am_lines_feed(am_lines *lines, const char *data, size_t len,
                   void (*on_line)(void *ctx, const char *line, size_t len), void *ctx) {
    while (len > 0) {
        const char *cut = memchr(data, 0xff, len); /* a resync: the partial line goes */
        size_t upto = cut != NULL ? (size_t)(cut - data) : len;
        const char *at = data;
        size_t left = upto;
        while (left > 0) {
            const char *newline = memchr(at, '\n', left);
            size_t piece = newline != NULL ? (size_t)(newline - at) : left;
            if (!lines->skipping && lines_keep(lines, at, piece) != 0) {
                lines->len = 0; /* out of memory: this line is lost */
                lines->skipping = true;
                lines->dropped++;
            }
            if (newline == NULL)
                break;
            if (!lines->skipping)
                on_line(ctx, lines->buf != NULL ? lines->buf : "", lines->len);
            lines->len = 0;
            lines->skipping = false;
            at = newline + 1;
            left -= piece + 1;
        }
        if (cut == NULL)
            break;
        lines->len = 0;
        lines->skipping = false;
        data = cut + 1;
        len -= upto + 1;
    }
}

/* -- what the agent says ----------------------------------------------------------------- */

static bool hex_between(const char *text, size_t len, size_t least, size_t most) {
    return text != NULL && len >= least && len <= most && strlen(text) == len &&
           strspn(text, "0123456789abcdef") == len;
}

static void bad(am_agent_message *out, const char *kind, const char *what) {
    out->kind = AM_AGENT_BAD;
    am_error_set(&out->error, "BAD_REQUEST", "invalid request: %s: %s", kind, what);
}

void am_agent_parse(const char *line, size_t len, const char *sid, am_agent_message *out) {
    memset(out, 0, sizeof *out);
    out->kind = AM_AGENT_OTHER;
    /* (the agent's lines are ASCII JSON objects with a type: wire.channel.encode) */
    json_object *message = NULL;
    if (len > 0 && len <= AM_AGENT_MAX_LINE && am_utf8_valid(line, len)) {
        struct json_tokener *tok = json_tokener_new_ex(AM_JSON_MAX_DEPTH);
        if (tok != NULL) {
            json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
            message = json_tokener_parse_ex(tok, line, (int)len);
            if (message != NULL && json_tokener_get_parse_end(tok) != len) {
                json_object_put(message); /* (junk after the object) */
                message = NULL;
            }
            json_tokener_free(tok);
        }
    }
    size_t type_len = 0;
    const char *type = am_json_str(message, "type", &type_len);
    if (message == NULL || !json_object_is_type(message, json_type_object) || type == NULL) {
        json_object_put(message);
        am_warn("the guest agent sent a line that is not a message: dropped");
        return;
    }
    out->message = message;
    int64_t id;
    if (am_json_i64(am_json_get(message, "id"), &id)) {
        out->id = id;
        out->has_id = true;
    }
    if (strcmp(type, "result") == 0) {
        out->kind = AM_AGENT_RESULT;
        size_t got_len = 0;
        const char *got = am_json_str(am_json_get(message, "result"), "registered", &got_len);
        bool ok = false;
        out->registered = am_json_bool(am_json_get(message, "ok"), &ok) && ok && got != NULL &&
                          got_len == strlen(sid) && strcmp(got, sid) == 0;
        return;
    }
    bool resume = strcmp(type, "resume") == 0, prove = strcmp(type, "prove") == 0;
    if (!resume && !prove)
        return; /* (nothing this driver answers) */
    if (!out->has_id)
        return; /* an answer could not be told from another: none (the agent drops it anyway) */
    size_t asked_len = 0;
    const char *asked = am_json_str(message, "sid", &asked_len);
    json_object *asked_obj = am_json_get(message, "sid");
    if (asked_obj != NULL && (asked == NULL || asked_len != strlen(sid) || strcmp(asked, sid) != 0)) {
        bad(out, type, "sid is not the session this connection registered");
        return;
    }
    if (resume) {
        out->kind = AM_AGENT_RESUME;
        json_object *endpoint = am_json_get(message, "endpoint");
        size_t endpoint_len = 0;
        out->endpoint = am_json_str(message, "endpoint", &endpoint_len);
        char host[256];
        int port;
        if (endpoint != NULL && !json_object_is_type(endpoint, json_type_null) &&
            (out->endpoint == NULL || endpoint_len > AM_MAX_ENDPOINT || strlen(out->endpoint) != endpoint_len ||
             am_parse_endpoint(out->endpoint, host, sizeof host, &port) != 0)) {
            bad(out, type, "endpoint must be HOST:PORT or null");
            return;
        }
        json_object *ticket = am_json_get(message, "ticket");
        size_t ticket_len = 0;
        out->ticket = am_json_str(message, "ticket", &ticket_len);
        if (ticket != NULL && !json_object_is_type(ticket, json_type_null) &&
            (out->ticket == NULL || ticket_len > AM_MAX_TICKET || strlen(out->ticket) != ticket_len)) {
            bad(out, type, "ticket must be a string of at most 4096 characters or null");
            return;
        }
        return;
    }
    out->kind = AM_AGENT_PROVE;
    size_t host_len = 0;
    out->host = am_json_str(message, "host", &host_len);
    if (out->host == NULL || host_len == 0 || host_len > 256 || strlen(out->host) != host_len) {
        bad(out, type, "host must be the asking host's name (1 to 256 characters)");
        return;
    }
    json_object *challenges = am_json_get(message, "challenges");
    if (challenges == NULL || !json_object_is_type(challenges, json_type_object) ||
        json_object_object_length(challenges) < 1 || json_object_object_length(challenges) > MAX_INSTANCES) {
        bad(out, type, "challenges must be an object of 1 to 128 {instance: challenge}");
        return;
    }
    json_object_object_foreach(challenges, instance, challenge) {
        size_t challenge_len = challenge != NULL && json_object_is_type(challenge, json_type_string)
                                   ? (size_t)json_object_get_string_len(challenge)
                                   : 0;
        if (!hex_between(instance, strlen(instance), 4, 32) || challenge_len == 0 ||
            !hex_between(json_object_get_string(challenge), challenge_len, 16, 128)) {
            bad(out, type, "a pool instance is 4 to 32 hex digits, a challenge 16 to 128");
            return;
        }
    }
    out->challenges = challenges;
}

void am_agent_message_free(am_agent_message *m) {
    json_object_put(m->message);
    m->message = NULL;
}

/* -- what the driver answers -------------------------------------------------------------- */

int am_agent_result_error(am_buf *out, int64_t id, const am_error *err) {
    int rc = am_buf_printf(out, "{\"type\":\"result\",\"id\":%" PRId64 ",\"ok\":false,\"error\":{\"code\":", id);
    rc |= am_buf_json_string(out, err->code[0] ? err->code : "INTERNAL", strlen(err->code[0] ? err->code : "INTERNAL"));
    rc |= am_buf_puts(out, ",\"message\":");
    rc |= am_buf_json_string(out, err->message, strlen(err->message));
    rc |= am_buf_puts(out, "}}\n");
    return rc;
}

int am_agent_result_resume(am_buf *out, int64_t id, const char *sid, const am_resume_outcome *o) {
    int rc = am_buf_printf(out, "{\"type\":\"result\",\"id\":%" PRId64 ",\"ok\":true,\"result\":{\"sid\":", id);
    rc |= am_buf_json_string(out, sid, strlen(sid));
    rc |= am_buf_printf(out, ",\"epoch\":%" PRIu64 ",\"endpoint\":", o->epoch);
    rc |= am_buf_json_string(out, o->endpoint, strlen(o->endpoint));
    rc |= am_buf_printf(out, ",\"replayed\":%" PRIu64 ",\"resent\":%" PRIu64 ",\"seconds\":%.6f,\"ticket\":%s,"
                        "\"tls_resumed\":%s", o->replayed, o->resent, o->seconds, o->ticket ? "true" : "false",
                        o->tls_resumed ? "true" : "false");
    if (o->already)
        rc |= am_buf_puts(out, ",\"already\":true");
    else
        rc |= am_buf_printf(out, ",\"times\":{\"asked\":%.6f,\"connected\":%.6f,\"answered\":%.6f}", o->asked,
                            o->connected, o->answered);
    rc |= am_buf_puts(out, "}}\n");
    return rc;
}

int am_agent_result_prove(am_buf *out, int64_t id, const char *sid, const char *domain, const char *proof) {
    int rc = am_buf_printf(out, "{\"type\":\"result\",\"id\":%" PRId64 ",\"ok\":true,\"result\":{\"sid\":", id);
    rc |= am_buf_json_string(out, sid, strlen(sid));
    rc |= am_buf_printf(out, ",\"domain\":\"%s\",\"proof\":\"%s\"}}\n", domain, proof);
    return rc;
}

/* -- the registration's thread ------------------------------------------------------------- */

static double now_s(void) {
    return am_now();
}

/* Wait `seconds` or until stopped: true when stopped. */
static bool wait_stop(am_registration *r, double seconds) {
    struct pollfd pfd = {.fd = r->stop_fd, .events = POLLIN};
    int rc;
    do {
        rc = poll(&pfd, 1, (int)(seconds * 1000));
    } while (rc < 0 && errno == EINTR);
    return rc > 0;
}

static bool stopped(am_registration *r) {
    return wait_stop(r, 0);
}

static int connect_agent(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The whole line within SEND_TIMEOUT (a unix socket: never a SIGPIPE). */
static int send_line(am_registration *r, const am_buf *line) {
    double deadline = now_s() + SEND_TIMEOUT;
    size_t done = 0;
    while (done < line->len) {
        ssize_t n = send(r->fd, line->data + done, line->len - done, MSG_NOSIGNAL);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return -1;
        double left = deadline - now_s();
        struct pollfd pfd = {.fd = r->fd, .events = POLLOUT};
        if (left <= 0 || (poll(&pfd, 1, (int)(left * 1000) + 1) < 0 && errno != EINTR))
            return -1;
    }
    return 0;
}

static int send_register(am_registration *r, const char *type) {
    am_session *s = r->session;
    char endpoint[320];
    am_session_endpoint(s, endpoint, sizeof endpoint);
    const char *sid = am_session_sid(s);
    am_buf line;
    am_buf_init(&line);
    int rc = am_buf_printf(&line, "{\"type\":\"%s\",\"id\":%" PRId64 ",\"sid\":", type, r->next_id++);
    rc |= am_buf_json_string(&line, sid, strlen(sid));
    if (strcmp(type, "register") == 0) {
        rc |= am_buf_puts(&line, ",\"endpoint\":");
        rc |= am_buf_json_string(&line, endpoint, strlen(endpoint));
        rc |= am_buf_printf(&line, ",\"pid\":%ld,\"name\":", (long)getpid());
        const char *name = am_session_name(s);
        rc |= am_buf_json_string(&line, name, strlen(name));
        rc |= am_buf_printf(&line, ",\"epoch\":%" PRIu64, am_session_epoch(s));
    }
    rc |= am_buf_puts(&line, "}\n");
    rc = rc != 0 ? -1 : send_line(r, &line);
    am_buf_free(&line);
    return rc;
}

static void answer(am_registration *r, const am_agent_message *m) {
    am_session *s = r->session;
    const char *sid = am_session_sid(s);
    am_buf line;
    am_buf_init(&line);
    am_error err = {0};
    int rc;
    if (m->kind == AM_AGENT_BAD) {
        rc = am_agent_result_error(&line, m->id, &m->error);
    } else if (m->kind == AM_AGENT_RESUME) {
        am_resume_outcome outcome;
        if (am_session_resume(s, m->endpoint, m->ticket, &outcome, &err) == 0)
            rc = am_agent_result_resume(&line, m->id, sid, &outcome);
        else
            rc = am_agent_result_error(&line, m->id, &err);
    } else {
        char proof[65], domain[40];
        if (am_session_bind_proof(s, m->host, m->challenges, proof, domain, &err) == 0) {
            rc = am_agent_result_prove(&line, m->id, sid, domain, proof);
            am_info("session %s: binding proof made for host %.100s, domain %s", sid, m->host, domain);
        } else {
            rc = am_agent_result_error(&line, m->id, &err);
            am_info("session %s: no binding proof for host %.100s: %s", sid, m->host, err.message);
        }
    }
    if (rc == 0 && send_line(r, &line) != 0) {
        shutdown(r->fd, SHUT_RDWR); /* (the read loop sees it gone) */
    }
    am_buf_free(&line);
}

static void on_line(void *ctx, const char *text, size_t len) {
    am_registration *r = ctx;
    am_agent_message m;
    am_agent_parse(text, len, am_session_sid(r->session), &m);
    if (m.kind == AM_AGENT_RESULT) {
        if (m.registered) {
            pthread_mutex_lock(&r->mu);
            r->registered = true;
            pthread_cond_broadcast(&r->cond);
            pthread_mutex_unlock(&r->mu);
        }
    } else if (m.kind != AM_AGENT_OTHER) {
        answer(r, &m);
    }
    am_agent_message_free(&m);
}

/* One connection's life: register, then answer until it closes or we stop. */
static void converse(am_registration *r) {
    if (send_register(r, "register") != 0)
        return;
    am_lines_free(&r->lines);
    am_lines_init(&r->lines);
    char chunk[16384];
    for (;;) {
        struct pollfd pfds[2] = {{.fd = r->fd, .events = POLLIN}, {.fd = r->stop_fd, .events = POLLIN}};
        int ready = poll(pfds, 2, -1);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready < 0 || pfds[1].revents)
            return;
        ssize_t n = recv(r->fd, chunk, sizeof chunk, 0);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            continue;
        if (n <= 0)
            return;
        am_lines_feed(&r->lines, chunk, (size_t)n, on_line, r);
    }
}

static void *registration_main(void *arg) {
    am_registration *r = arg;
    double absent = ABSENT_FIRST;
    while (!stopped(r)) {
        struct stat st;
        if (stat(r->path, &st) != 0) {
            if (wait_stop(r, absent))
                break;
            absent = absent * 2 > ABSENT_LONGEST ? ABSENT_LONGEST : absent * 2;
            continue;
        }
        absent = ABSENT_FIRST;
        r->fd = connect_agent(r->path);
        if (r->fd < 0) {
            if (wait_stop(r, RETRY))
                break;
            continue;
        }
        converse(r);
        if (stopped(r))
            break; /* (the connection is closed below, after the unregister) */
        pthread_mutex_lock(&r->mu);
        r->registered = false;
        pthread_mutex_unlock(&r->mu);
        close(r->fd);
        r->fd = -1;
        am_info("session %s: the guest agent went away; registering again", am_session_sid(r->session));
        if (wait_stop(r, RETRY))
            break;
    }
    if (r->fd >= 0) {
        send_register(r, "unregister"); /* (best effort: closing says the same) */
        close(r->fd);
        r->fd = -1;
    }
    return NULL;
}

am_registration *am_registration_start(am_session *s, const char *path) {
    if (path == NULL || path[0] == 0)
        return NULL; /* told not to: the driver works on its own */
    am_registration *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    r->session = s;
    r->fd = -1;
    r->next_id = 1;
    snprintf(r->path, sizeof r->path, "%s", path);
    r->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    am_lines_init(&r->lines);
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cond, &attr);
    pthread_condattr_destroy(&attr);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int started = r->stop_fd >= 0 ? pthread_create(&r->thread, NULL, registration_main, r) : EMFILE;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (started != 0) {
        am_error_log("session %s: cannot register with the guest agent (%s): no migration can rehome it",
                     am_session_sid(s), strerror(started));
        if (r->stop_fd >= 0)
            close(r->stop_fd);
        pthread_cond_destroy(&r->cond);
        pthread_mutex_destroy(&r->mu);
        free(r);
        return NULL;
    }
    struct stat st;
    if (stat(path, &st) == 0) {
        /* an agent runs here: the session is its before the application goes on */
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += (time_t)REGISTER_WAIT;
        pthread_mutex_lock(&r->mu);
        while (!r->registered && pthread_cond_timedwait(&r->cond, &r->mu, &until) != ETIMEDOUT) {
        }
        bool registered = r->registered;
        pthread_mutex_unlock(&r->mu);
        if (registered)
            am_info("session %s registered with the guest agent at %s", am_session_sid(s), path);
        else
            am_warn("session %s: the guest agent at %s did not take its registration within %.0f s (it goes "
                    "on trying)", am_session_sid(s), path, REGISTER_WAIT);
    }
    return r;
}

void am_registration_stop(am_registration *r) {
    if (r == NULL)
        return;
    uint64_t one = 1;
    ssize_t n = write(r->stop_fd, &one, sizeof one);
    (void)n;
    pthread_join(r->thread, NULL);
    close(r->stop_fd);
    am_lines_free(&r->lines);
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

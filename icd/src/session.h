/* A session on the pool (data-plane protocol 3): what one OpenCL context
 * computes through.  The same contract as the Python driver's session
 * (agent/driver/session.py): hello, open (with the session secret, which
 * never leaves this process otherwise), sequenced commands carrying the
 * session's epoch and the acknowledgement of replies seen, every command
 * kept in the window until its reply, and after a lost connection a resume
 * (HMAC proof over the pool's challenge, bound to the TLS channel) that
 * re-sends exactly what the pool lacks.
 *
 * After a migration the guest agent asks for a resume at another endpoint
 * with the migration's ticket (am_session_resume; the session registers
 * with the agent itself: agent.h); in a pool of several nodes an open may
 * be redirected to another node (once), and a resume told where the
 * session lives (once).  A reconnect offers the last connection's TLS
 * session to the same endpoint.  An idle connection sends the keepalive
 * the pool's welcome asks for.
 *
 * Connection states (one transition table, `state_to`):
 *
 *   CONNECTING --opened--> CONNECTED --lost, or an explicit resume--> DISCONNECTED
 *                              ^                                     |    ^
 *                              |                              resume |    | refused, unreachable
 *                              |                                     v    |
 *                              +-----------accepted-------------- RESUMING
 *   FAILED: the pool ended the session (lost, expired, diverged, killed),
 *           or no connection for `timeout` seconds: every command fails.
 *   CLOSED: am_session_close.
 *
 * fork(): the child holds a copy of each session, as a restored snapshot
 * of the guest does, without its threads or its connection (the parent's,
 * left alone: its descriptor closed in the child, never shut down).
 * Nothing goes to the pool from it while the child only lets objects go
 * (frees and releases stay in the child: the objects are the parent's
 * too); its first command resumes the copy, and the pool decides: once
 * the parent moved on, the copy is refused as diverged (SESSION_DIVERGED:
 * its commands fail, the parent's go on); a copy that resumes first takes
 * the session, and the parent is the one refused.
 *
 * Threads: the application's (submit, wait), and the session's I/O thread,
 * which alone reads and writes the socket after the open (OpenSSL objects
 * are not shared between threads), dispatches replies to the window, runs
 * each command's hook, acknowledges and reconnects.  `mu` guards the state,
 * the window, the epoch and the counters; hooks run without it.  Signals
 * are blocked on the I/O thread: they stay the application's. */
#ifndef ACCELMIG_SESSION_H
#define ACCELMIG_SESSION_H

#include <json-c/json.h>
#include <openssl/ssl.h>
#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "errors.h"
#include "window.h"

/* the data-plane protocol versions the OpenCL driver speaks (wire.opencl):
 * 3, and 4 for a launch's global work offset (a pool of 3 refuses those) */
#define AM_PROTOCOL_VERSION 3
#define AM_PROTOCOL_OFFSET 4
/* the longest migration ticket (wire.channel.MAX_TICKET) */
#define AM_MAX_TICKET 4096
/* the longest endpoint a pool or an agent may name (wire.dataplane.parse_redirect) */
#define AM_MAX_ENDPOINT 300

/* fork(): before it (take the hook's locks), after it in the parent, and
 * in the child (its threads are gone) */
enum am_fork_phase { AM_FORK_PREPARE, AM_FORK_PARENT, AM_FORK_CHILD };

typedef struct am_session_hooks {
    void *ctx;
    /* every command up to `upto` has completed on the device (I/O thread, no lock held) */
    void (*completed)(void *ctx, uint64_t upto);
    /* the session ended for good (I/O thread or the caller's, no lock held) */
    void (*failed)(void *ctx, const am_error *err);
    /* a fork(): PREPARE and PARENT/CHILD bracket it (the session's lock is taken after the hook's) */
    void (*fork)(void *ctx, enum am_fork_phase phase);
} am_session_hooks;

typedef struct am_session am_session;

/* Open a session on the device `device_id` (an id of am_list_devices').
 * `tls` NULL: plain TCP (insecure, said by the configuration). */
am_session *am_session_open(const am_config *cfg, SSL_CTX *tls, const char *device_id,
                            const am_session_hooks *hooks, am_error *err);
/* Release the session at the pool, stop its thread, free it (and every
 * command still in its window). */
void am_session_close(am_session *s);

/* A new buffer or program handle (chosen here: a re-sent command names the same object). */
uint64_t am_session_handle(am_session *s);
/* The largest payload one command may carry (larger transfers go in chunks). */
uint64_t am_session_chunk(const am_session *s);
const char *am_session_sid(const am_session *s);

/* Number `cmd`, keep it in the window and have it sent; it is the
 * session's from now on (a waited one is the waiter's again once done).
 * Blocks while the window is full.  `seq` (may be NULL): its number (the
 * command itself may be answered and freed by then).  -1 (cmd untouched,
 * still the caller's) when the session failed or closed. */
int am_session_submit(am_session *s, am_cmd *cmd, uint64_t *seq, am_error *err);
/* Block until a waited command's outcome is in; the caller then frees it. */
void am_session_wait(am_session *s, am_cmd *cmd);
/* The last sequence number given out (0: none yet). */
uint64_t am_session_last_seq(am_session *s);
/* Make sure command `seq` is known complete some time soon: a finish
 * follows it unless a command that completes on its reply already does. */
void am_session_ensure_completion(am_session *s, uint64_t seq);
/* Every command up to the returned one completed on the device. */
uint64_t am_session_completed(am_session *s);
/* true on the session's own I/O thread (a hook calling back in). */
bool am_session_on_io_thread(const am_session *s);
/* true (and why, if `err`) once the session failed. */
bool am_session_failed(am_session *s, am_error *err);

/* What a resume the guest agent asked for did (its answer: the Python
 * driver's resume() result). */
typedef struct am_resume_outcome {
    uint64_t epoch;
    uint64_t replayed;           /* replies the pool replayed */
    uint64_t resent;             /* commands re-sent */
    double seconds;
    bool ticket;                 /* a migration's ticket moved it */
    bool already;                /* that move had happened already (the rehome came twice) */
    bool tls_resumed;
    char endpoint[320];
    double asked, connected, answered;   /* wall clock: the migration's timeline */
} am_resume_outcome;

/* Continue the session at `endpoint` (NULL or "": where it is), with a
 * migration's `ticket` (NULL or "": none): what the guest agent asks after
 * a migration.  The session's I/O thread does it (a reconnect in its way
 * gives up at once); this blocks until it has.  A pool that says the
 * session lives on another node is asked there, once.  0 and `out`, or -1
 * and the pool's refusal (a retriable one: the I/O thread keeps trying
 * there, with the ticket). */
int am_session_resume(am_session *s, const char *endpoint, const char *ticket, am_resume_outcome *out,
                      am_error *err);
/* wire.attestation.bind_proof for this session: the proof that binds it to
 * `domain` (this guest's, as the driver reads it) on `host`, for the
 * challenge of its own pool instance among `challenges`
 * ({instance: challenge}).  0 (proof: 64 hex digits, domain: the one it was
 * made for), or -1 and why (no domain known, no challenge of its instance). */
int am_session_bind_proof(am_session *s, const char *host, json_object *challenges, char proof[65],
                          char domain[40], am_error *err);
/* The protocol version the pool agreed to at the last connection. */
unsigned am_session_version(am_session *s);
/* The session's epoch and where it is now (copied: the I/O thread changes them). */
uint64_t am_session_epoch(am_session *s);
void am_session_endpoint(am_session *s, char *out, size_t size);

/* This process's name, as the pool and the guest agent are told. */
const char *am_session_name(const am_session *s);

/* A session with no connection and no thread, whose window holds
 * `pending` commands (1, 2, ...): what the unit tests and the fuzz
 * harness feed what a pool might send (am_session_feed: the bytes as the
 * I/O thread reads them).  Freed with am_session_close. */
am_session *am_session_offline(uint32_t pending);
/* 0, or -1 when the bytes would cost the connection (err: why). */
int am_session_feed(am_session *s, const uint8_t *data, size_t len, am_error *err);
/* A handshake's answer (a header's text: welcome, redirect, error) read as
 * the session reads it: 0 when it was taken, else -1 and why. */
int am_session_check_answer(am_session *s, const uint8_t *text, size_t len, am_error *err);

/* The pool's devices a token may open on: the `devices` answer of a
 * list_devices (the caller owns it), or NULL and why. */
json_object *am_list_devices(const am_config *cfg, SSL_CTX *tls, am_error *err);

/* wire.attestation.bind_proof: HMAC-SHA256(secret, "accelmig-bind-1|instance|challenge|host|domain|sid"), hex. */
void am_bind_proof(const unsigned char *secret, size_t secret_len, const char *instance, const char *challenge,
                   const char *host, const char *domain, const char *sid, char out[65]);

/* wire.dataplane.ownership_proof: HMAC-SHA256(secret, "challenge|sid|epoch[|binding]"), hex. */
void am_ownership_proof(const unsigned char *secret, size_t secret_len, const char *challenge, const char *sid,
                        uint64_t epoch, const unsigned char *binding, size_t binding_len, char out[65]);

#endif

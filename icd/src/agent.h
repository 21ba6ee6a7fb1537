/* The driver's side of the guest agent's local socket: agent/driver/
 * registry.py's twin (the contract: wire/channel.py, "Local socket").
 *
 * Each session registers with the agent (if one runs in this guest) over a
 * connection of its own, kept for the session's life: the agent notices a
 * driver that dies when that connection closes.  Over it the agent asks
 *
 *   resume  {endpoint, ticket, migration_id}: after a migration, continue
 *           the session at the new host's endpoint with the migration's
 *           ticket (am_session_resume); answered with what happened;
 *   prove   {host, challenges}: the session's binding proof for the pool's
 *           challenge of its own node (wire/attestation.py), made with the
 *           session's secret for the domain this driver reads itself;
 *
 * and the driver answers each with a `result` of the request's id.  When
 * the agent goes away (restarted), the session registers again; while no
 * agent socket exists it looks again now and then (1 s, doubling to 30 s):
 * an application started at boot may come up before the agent.
 *
 * Lines are newline-delimited JSON of at most AM_AGENT_MAX_LINE bytes (a
 * longer one is dropped up to its newline; a 0xFF byte drops a partial
 * line, as wire.channel.LineParser does).  Everything the agent sends is
 * checked before it is used (am_agent_parse, fuzzed): it is root's process,
 * but whoever holds the socket's path is believed to be it by nobody.
 *
 * Threads: one per registration (signals blocked: they stay the
 * application's); it alone uses its connection. */
#ifndef ACCELMIG_AGENT_H
#define ACCELMIG_AGENT_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>

#include "buffer.h"
#include "errors.h"
#include "session.h"

#define AM_AGENT_MAX_LINE (256 * 1024)

typedef struct am_registration am_registration;

/* Keep `s` registered with the agent at `path` (a thread of its own) until
 * am_registration_stop.  When the socket is there, waits (2 s at most) for
 * the agent to take the registration.  NULL: `path` is "" (told not to),
 * or no thread could start (said in the log: the session works on, but no
 * agent can rehome it). */
am_registration *am_registration_start(am_session *s, const char *path);
/* Unregister, stop the thread and free (NULL: nothing). */
void am_registration_stop(am_registration *r);

/* Newline-delimited lines out of a stream, bounded. */
typedef struct am_lines {
    char *buf;
    size_t len, cap;
    bool skipping;       /* inside a line over the bound: dropped up to its newline */
    unsigned dropped;
} am_lines;

void am_lines_init(am_lines *lines);
void am_lines_free(am_lines *lines);
/* Every complete line of `data` to `on_line` (without its newline). */
void am_lines_feed(am_lines *lines, const char *data, size_t len,
                   void (*on_line)(void *ctx, const char *line, size_t len), void *ctx);

typedef enum am_agent_kind {
    AM_AGENT_OTHER,      /* nothing this driver answers (an event, an unknown type): ignored */
    AM_AGENT_RESULT,     /* the answer to our register (or unregister) */
    AM_AGENT_RESUME,
    AM_AGENT_PROVE,
    AM_AGENT_BAD,        /* a request that cannot be answered as asked (`error` says why) */
} am_agent_kind;

typedef struct am_agent_message {
    am_agent_kind kind;
    json_object *message;        /* owned: the whole line */
    int64_t id;                  /* the request's id (echoed in its result) */
    bool has_id;
    const char *endpoint;        /* resume: where to ("" or NULL: where it is) */
    const char *ticket;          /* resume: the migration's ticket (NULL: none) */
    const char *host;            /* prove: the host that asks */
    json_object *challenges;     /* prove: {instance: challenge}, checked (borrowed) */
    bool registered;             /* result: the agent registered the session */
    am_error error;              /* bad: why */
} am_agent_message;

/* One line from the agent, checked; `sid` is the session's (a result
 * names it).  The caller frees it (am_agent_message_free). */
void am_agent_parse(const char *line, size_t len, const char *sid, am_agent_message *out);
void am_agent_message_free(am_agent_message *m);

/* The result lines this driver answers with. */
int am_agent_result_error(am_buf *out, int64_t id, const am_error *err);
int am_agent_result_resume(am_buf *out, int64_t id, const char *sid, const am_resume_outcome *outcome);
int am_agent_result_prove(am_buf *out, int64_t id, const char *sid, const char *domain, const char *proof);

#endif

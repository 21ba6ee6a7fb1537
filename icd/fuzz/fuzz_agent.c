/* libFuzzer: what the guest agent (or whatever holds its socket's path)
 * may send a driver, in the chunk sizes the first byte picks: split into
 * lines, each checked (am_agent_parse) and answered as the registration's
 * thread answers it (a proof made with an offline session's secret, a
 * resume's outcome or refusal formatted).  Nothing may crash, leak or be
 * undefined, and every answer must be one line of JSON. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"
#include "json.h"

static void on_line(void *ctx, const char *line, size_t len) {
    am_session *s = ctx;
    am_agent_message m;
    am_agent_parse(line, len, am_session_sid(s), &m);
    am_buf out;
    am_buf_init(&out);
    am_error err = {0};
    if (m.kind == AM_AGENT_BAD) {
        am_agent_result_error(&out, m.id, &m.error);
    } else if (m.kind == AM_AGENT_PROVE) {
        char proof[65], domain[40];
        if (am_session_bind_proof(s, m.host, m.challenges, proof, domain, &err) == 0)
            am_agent_result_prove(&out, m.id, am_session_sid(s), domain, proof);
        else
            am_agent_result_error(&out, m.id, &err);
    } else if (m.kind == AM_AGENT_RESUME) {
        am_resume_outcome outcome;
        memset(&outcome, 0, sizeof outcome);
        if (m.endpoint != NULL)
            strncpy(outcome.endpoint, m.endpoint, sizeof outcome.endpoint - 1);
        outcome.ticket = m.ticket != NULL && m.ticket[0] != 0;
        am_agent_result_resume(&out, m.id, am_session_sid(s), &outcome);
    }
    if (out.len > 0) {
        /* one line, a JSON object */
        if (out.data[out.len - 1] != '\n' || memchr(out.data, '\n', out.len - 1) != NULL)
            abort();
        struct json_tokener *tok = json_tokener_new();
        json_object *parsed = json_tokener_parse_ex(tok, (const char *)out.data, (int)(out.len - 1));
        if (parsed == NULL)
            abort();
        json_object_put(parsed);
        json_tokener_free(tok);
    }
    am_buf_free(&out);
    am_agent_message_free(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    size_t chunk = (size_t)data[0] * 13 + 1;
    data++, size--;
    am_session *s = am_session_offline(0);
    if (s == NULL)
        return 0;
    am_lines lines;
    am_lines_init(&lines);
    for (size_t at = 0; at < size;) {
        size_t n = size - at < chunk ? size - at : chunk;
        am_lines_feed(&lines, (const char *)data + at, n, on_line, s);
        at += n;
    }
    am_lines_free(&lines);
    am_session_close(s);
    return 0;
}

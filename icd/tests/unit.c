/* Unit tests of the driver's internals, without a pool: the frame reader
 * and the session's dispatch of what a pool sends, the window, rectangles,
 * the configuration file, device parameters, exact integers, UTF-8.
 * tests/icd runs it (and again under ASan + UBSan).
 *
 *   icd-unit                 every test; exit status 0 when all pass
 *   icd-unit params          the device parameter table (name code kind per line)
 *   icd-unit proof SECRET CHALLENGE SID EPOCH BINDING   (hex secret and binding)
 *   icd-unit bind SECRET INSTANCE CHALLENGE HOST DOMAIN SID   (a binding proof; hex secret)
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"
#include "config.h"
#include "devparams.h"
#include "frame.h"
#include "includes.h"
#include "json.h"
#include "rect.h"
#include "session.h"
#include "window.h"

static int failures, checks;

#define EXPECT(cond)                                                                                            \
    do {                                                                                                        \
        checks++;                                                                                               \
        if (!(cond)) {                                                                                          \
            printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);                                            \
            failures++;                                                                                         \
        }                                                                                                       \
    } while (0)

static void frame(am_buf *out, const char *header, const void *payload, size_t len) {
    am_frame_head(out, header, strlen(header), len);
    am_buf_append(out, payload, len);
}

typedef struct seen {
    int frames;
    char last_op[32];
    uint64_t last_len;
    bool last_in_sink;
} seen;

static int count_frame(void *ctx, json_object *header, const uint8_t *payload, uint64_t len, bool in_sink) {
    (void)payload;
    seen *s = ctx;
    s->frames++;
    snprintf(s->last_op, sizeof s->last_op, "%s", am_json_op(header));
    s->last_len = len;
    s->last_in_sink = in_sink;
    return 0;
}

static uint8_t sink_area[100000];

static void *test_sink(void *ctx, json_object *header, uint64_t size) {
    (void)ctx, (void)header;
    return size == sizeof sink_area ? sink_area : NULL;
}

static void test_frames(void) {
    am_buf stream;
    am_buf_init(&stream);
    frame(&stream, "{\"op\":\"welcome\",\"version\":3}", NULL, 0);
    frame(&stream, "{\"op\":\"reply\",\"seq\":1}", "abc", 3);
    uint8_t *big = calloc(1, sizeof sink_area);
    frame(&stream, "{\"op\":\"reply\",\"seq\":2}", big, sizeof sink_area);
    frame(&stream, "{\"op\":\"reply\",\"seq\":3}", big, 70000); /* large, no sink: the reader's own */
    free(big);
    /* fed in every chunk size from 1 byte up: the same frames */
    for (size_t chunk = 1; chunk < 70; chunk += 7) {
        am_reader r;
        seen s = {0};
        EXPECT(am_reader_init(&r, 4096, 1 << 20, 1 << 17, test_sink, NULL) == 0);
        for (size_t at = 0; at < stream.len;) {
            size_t space_len;
            uint8_t *space = am_reader_space(&r, &space_len);
            size_t n = stream.len - at < chunk ? stream.len - at : chunk;
            if (n > space_len)
                n = space_len;
            memcpy(space, stream.data + at, n);
            at += n;
            EXPECT(am_reader_feed(&r, n, count_frame, &s) == 0);
        }
        EXPECT(s.frames == 4);
        EXPECT(strcmp(s.last_op, "reply") == 0 && s.last_len == 70000 && !s.last_in_sink);
        EXPECT(am_reader_idle(&r));
        am_reader_free(&r);
    }
    am_buf_free(&stream);

    /* what breaks a connection, each with its reason */
    const char *bad[] = {"{\"op\":1}", "[1,2]", "{\"op\":\"x\"} junk", "{\"op\":\"x\",", "{\"op\":\"\\ud800\"}x",
                         "{'op':'x'}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        am_buf one;
        am_buf_init(&one);
        frame(&one, bad[i], NULL, 0);
        am_reader r;
        seen s = {0};
        am_reader_init(&r, 4096, 1 << 20, 1 << 17, NULL, NULL);
        size_t space_len;
        memcpy(am_reader_space(&r, &space_len), one.data, one.len);
        EXPECT(am_reader_feed(&r, one.len, count_frame, &s) == -1 && s.frames == 0 && r.error[0] != 0);
        EXPECT(am_reader_space(&r, &space_len) == NULL); /* broken for good */
        am_reader_free(&r);
        am_buf_free(&one);
    }
    /* (json-c takes NaN and lone surrogates: they become a double and a
     * replacement character, which no reader of a field accepts) */
    uint8_t prefix[16] = {'A', 'M', 1, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0}; /* an 8 KiB header */
    am_reader r;
    seen s = {0};
    am_reader_init(&r, 4096, 1 << 20, 1 << 17, NULL, NULL);
    size_t space_len;
    memcpy(am_reader_space(&r, &space_len), prefix, sizeof prefix);
    EXPECT(am_reader_feed(&r, sizeof prefix, count_frame, &s) == -1 && strstr(r.error, "header") != NULL);
    am_reader_free(&r);
    uint8_t huge[16] = {'A', 'M', 1, 0, 0, 0, 0, 2, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    am_reader_init(&r, 4096, 1 << 20, 1 << 17, NULL, NULL);
    memcpy(am_reader_space(&r, &space_len), huge, sizeof huge);
    EXPECT(am_reader_feed(&r, sizeof huge, count_frame, &s) == -1 && strstr(r.error, "payload") != NULL);
    am_reader_free(&r);
    /* a large payload no sink takes costs at most max_unsunk */
    uint8_t unasked[16] = {'A', 'M', 1, 0, 0, 0, 0, 14, 0, 0, 0, 0, 0, 0x08, 0, 0}; /* 512 KiB */
    am_reader_init(&r, 4096, 1 << 20, 1 << 17, NULL, NULL);
    memcpy(am_reader_space(&r, &space_len), unasked, sizeof unasked);
    memcpy(r.staging + sizeof unasked, "{\"op\":\"reply\"}", 14);
    EXPECT(am_reader_feed(&r, sizeof unasked + 14, count_frame, &s) == -1 && strstr(r.error, "nothing asked") != NULL);
    am_reader_free(&r);
}

static void test_dispatch(void) {
    am_session *s = am_session_offline(6);
    am_error err;
    am_buf stream;
    am_buf_init(&stream);
    frame(&stream, "{\"op\":\"reply\",\"seq\":1,\"ok\":true}", "0123456789", 10);
    frame(&stream, "{\"op\":\"done\",\"from\":2,\"to\":3}", NULL, 0);
    frame(&stream, "{\"op\":\"done\",\"from\":1,\"to\":3}", NULL, 0); /* a replay: duplicates */
    frame(&stream, "{\"op\":\"reply\",\"seq\":4,\"ok\":false,\"error\":{\"code\":\"OUT_OF_RANGE\",\"message\":\"m\"}}",
          NULL, 0);
    EXPECT(am_session_feed(s, stream.data, stream.len, &err) == 0);
    am_buf_free(&stream);
    am_buf_init(&stream);
    frame(&stream, "{\"op\":\"reply\",\"seq\":6,\"ok\":true}", NULL, 0); /* out of order */
    EXPECT(am_session_feed(s, stream.data, stream.len, &err) == -1 && strcmp(err.code, "PROTOCOL_ERROR") == 0);
    am_buf_free(&stream);
    am_session_close(s);

    s = am_session_offline(2);
    am_buf_init(&stream);
    frame(&stream, "{\"op\":\"done\",\"from\":1,\"to\":9}", NULL, 0); /* past what was sent */
    EXPECT(am_session_feed(s, stream.data, stream.len, &err) == -1);
    am_buf_free(&stream);
    am_session_close(s);

    s = am_session_offline(2);
    am_buf_init(&stream);
    frame(&stream, "{\"op\":\"error\",\"error\":{\"code\":\"SESSION_LOST\",\"message\":\"gone\"}}", NULL, 0);
    EXPECT(am_session_feed(s, stream.data, stream.len, &err) == -1 && strcmp(err.code, "SESSION_LOST") == 0);
    EXPECT(am_error_terminal(&err));
    am_buf_free(&stream);
    am_session_close(s);
}

static void test_window(void) {
    am_window w;
    EXPECT(am_window_init(&w, 3, 1000) == 0);
    EXPECT(am_window_has_room(&w, 5000)); /* one command always fits */
    for (int i = 0; i < 100; i++)
        am_window_add(&w, am_cmd_new("read", "", NULL, 0, false));
    EXPECT(w.next_seq == 101 && w.count == 100 && !am_window_has_room(&w, 0));
    bool bad;
    am_cmd *cmd = am_window_complete(&w, 2, &bad);
    EXPECT(cmd == NULL && bad); /* out of order */
    cmd = am_window_complete(&w, 1, &bad);
    EXPECT(cmd != NULL && !bad && cmd->seq == 1 && w.last_seen == 1);
    am_cmd_free(cmd);
    EXPECT(am_window_complete(&w, 1, &bad) == NULL && !bad); /* a duplicate */
    EXPECT(am_window_get(&w, 50)->seq == 50 && am_window_get(&w, 1) == NULL && am_window_get(&w, 101) == NULL);
    am_cmd **left;
    size_t n = am_window_drain(&w, &left);
    EXPECT(n == 99 && left[0]->seq == 2 && left[98]->seq == 100 && w.last_seen == 100);
    for (size_t i = 0; i < n; i++)
        am_cmd_free(left[i]);
    free(left);
    am_window_free(&w);
}

static void test_rects(void) {
    am_rect r;
    size_t origin[3] = {3, 2, 1}, region[3] = {5, 4, 2};
    EXPECT(am_rect_make(&r, origin, region, 0, 0) == CL_SUCCESS && r.row_pitch == 5 && r.slice_pitch == 20);
    EXPECT(am_rect_make(&r, origin, region, 16, 100) == CL_INVALID_VALUE); /* 100 is no multiple of 16 */
    EXPECT(am_rect_make(&r, origin, region, 4, 0) == CL_INVALID_VALUE);    /* a row shorter than its width */
    size_t zero[3] = {5, 0, 1};
    EXPECT(am_rect_make(&r, origin, zero, 0, 0) == CL_INVALID_VALUE);
    size_t huge_origin[3] = {0, 0, SIZE_MAX / 2}, one[3] = {1, 1, 1};
    EXPECT(am_rect_make(&r, huge_origin, one, 8, 64) == CL_INVALID_VALUE); /* overflows */
    EXPECT(am_rect_make(&r, origin, region, 16, 128) == CL_SUCCESS);
    EXPECT(r.offset == 128 + 32 + 3 && r.extent == r.offset + 128 + 48 + 5);
    uint8_t host[512], packed[40], back[512];
    for (size_t i = 0; i < sizeof host; i++)
        host[i] = (uint8_t)i;
    am_rect_pack(&r, host, packed);
    EXPECT(packed[0] == host[r.offset] && packed[5] == host[r.offset + 16] && packed[20] == host[r.offset + 128]);
    memset(back, 0, sizeof back);
    am_rect_unpack(&r, back, packed);
    EXPECT(back[r.offset] == host[r.offset] && back[r.offset + 128 + 48 + 4] == host[r.offset + 128 + 48 + 4]);
    /* overlap as the brute force says, over many placements */
    for (size_t sx = 0; sx < 6; sx++)
        for (size_t dx = 0; dx < 6; dx++)
            for (size_t dy = 0; dy < 4; dy++) {
                size_t so[3] = {sx, 0, 0}, d0[3] = {dx, dy, 0}, reg[3] = {3, 2, 1};
                am_rect s, d;
                am_rect_make(&s, so, reg, 8, 0);
                am_rect_make(&d, d0, reg, 8, 0);
                bool touched[64] = {false}, brute = false;
                for (size_t y = 0; y < 2; y++)
                    for (size_t x = 0; x < 3; x++)
                        touched[s.offset + y * 8 + x] = true;
                for (size_t y = 0; y < 2; y++)
                    for (size_t x = 0; x < 3; x++)
                        brute |= touched[d.offset + y * 8 + x];
                EXPECT(am_rect_overlap(&s, &d) == brute);
            }
}

static void test_config(void) {
    am_config cfg;
    am_error err;
    am_config_defaults(&cfg);
    const char *text = "# accelmig driver\n"
                       "endpoint = \"10.88.0.1:7070\"  # the pool\n"
                       "token = \"t-\\\"quoted\\\"\"\n"
                       "insecure = false\n"
                       "timeout = 12.5\n"
                       "[other]\nendpoint = \"not this\"\n"
                       "[driver]\ncafile = \"/etc/accelmig/ca.pem\"\nsomething_new = 1\n";
    EXPECT(am_config_parse(&cfg, text, strlen(text), "test", &err) == 0);
    EXPECT(strcmp(cfg.endpoint, "10.88.0.1:7070") == 0 && strcmp(cfg.token, "t-\"quoted\"") == 0);
    EXPECT(cfg.insecure == 0 && cfg.timeout == 12.5 && strcmp(cfg.cafile, "/etc/accelmig/ca.pem") == 0);
    const char *bad[] = {"endpoint = 10.0.0.1:7070\n", "insecure = \"yes\"\n", "timeout = -1\n", "timeout = abc\n",
                         "just words\n", "token = \"unterminated\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        am_config_defaults(&cfg);
        EXPECT(am_config_parse(&cfg, bad[i], strlen(bad[i]), "test", &err) == -1 &&
               strcmp(err.code, "CONFIG_INVALID") == 0);
    }
    am_config_defaults(&cfg);
    EXPECT(am_config_ready(&cfg, &err) == -1 && strstr(err.message, "endpoint") != NULL);
}

static void test_params(void) {
    char why[128];
    const char *text = "{\"op\":\"x\",\"cl\":{\"CL_DEVICE_MAX_COMPUTE_UNITS\":8,\"CL_DEVICE_NAME\":\"dev\","
                       "\"CL_DEVICE_MAX_WORK_ITEM_SIZES\":[4,5,6],\"CL_DEVICE_IMAGE_SUPPORT\":true,"
                       "\"CL_DEVICE_GLOBAL_MEM_SIZE\":18446744073709551615,\"CL_DEVICE_VENDOR_ID\":4294967296,"
                       "\"CL_DEVICE_EXTENSIONS\":\"cl_khr_fp64  cl_khr_spir cl_khr_3d_image_writes cl_khr_fp16\","
                       "\"CL_DEVICE_EXTENSIONS_WITH_VERSION\":[[4194304,\"cl_khr_fp64\"],[4194304,\"cl_khr_spir\"]],"
                       "\"CL_DEVICE_SVM_CAPABILITIES\":11,\"CL_DEVICE_PROFILE\":1.5}}";
    json_object *obj = am_json_parse_header(text, strlen(text), why, sizeof why);
    EXPECT(obj != NULL);
    am_devparams p;
    EXPECT(am_devparams_decode(&p, am_json_get(obj, "cl")) == 0);
    EXPECT(am_devparams_uint(&p, CL_DEVICE_MAX_COMPUTE_UNITS) == 8);
    EXPECT(am_devparams_uint(&p, CL_DEVICE_GLOBAL_MEM_SIZE) == UINT64_MAX); /* exact, past 2**53 */
    EXPECT(am_devparams_get(&p, CL_DEVICE_VENDOR_ID) == NULL);             /* no cl_uint */
    EXPECT(am_devparams_get(&p, CL_DEVICE_PROFILE) == NULL);               /* not a string */
    const am_param_value *sizes = am_devparams_get(&p, CL_DEVICE_MAX_WORK_ITEM_SIZES);
    EXPECT(sizes != NULL && sizes->len == 3 * sizeof(size_t) && ((size_t *)sizes->bytes)[2] == 6);
    am_devparams_restrict(&p);
    EXPECT(am_devparams_uint(&p, CL_DEVICE_IMAGE_SUPPORT) == CL_FALSE);
    EXPECT(am_devparams_uint(&p, CL_DEVICE_SVM_CAPABILITIES) == 0);
    EXPECT(strcmp(am_devparams_str(&p, CL_DEVICE_EXTENSIONS), "cl_khr_fp64 cl_khr_fp16") == 0);
    const am_param_value *versions = am_devparams_get(&p, CL_DEVICE_EXTENSIONS_WITH_VERSION);
    EXPECT(versions != NULL && versions->len == sizeof(cl_name_version));
    am_devparams_free(&p);
    json_object_put(obj);
}

static void test_json_and_text(void) {
    char why[128];
    const char *text = "{\"op\":\"x\",\"big\":9223372036854775807,\"bigger\":9223372036854775808,\"neg\":-1,"
                       "\"f\":1.0,\"b\":true}";
    json_object *obj = am_json_parse_header(text, strlen(text), why, sizeof why);
    uint64_t u;
    int64_t i;
    EXPECT(am_json_u64(am_json_get(obj, "big"), &u) && u == 9223372036854775807ull);
    EXPECT(am_json_u64(am_json_get(obj, "bigger"), &u) && u == 9223372036854775808ull);
    EXPECT(!am_json_i64(am_json_get(obj, "bigger"), &i));
    EXPECT(!am_json_u64(am_json_get(obj, "neg"), &u) && am_json_i64(am_json_get(obj, "neg"), &i) && i == -1);
    EXPECT(!am_json_u64(am_json_get(obj, "f"), &u) && !am_json_u64(am_json_get(obj, "b"), &u));
    json_object_put(obj);
    EXPECT(am_json_parse_header("{\"a\":1}", 7, why, sizeof why) == NULL && strstr(why, "op") != NULL);
    EXPECT(am_utf8_valid("h\xc3\xa9llo", 6) && !am_utf8_valid("\xc3", 1) && !am_utf8_valid("\xed\xa0\x80", 3) &&
           !am_utf8_valid("\xc0\xaf", 2));
    am_buf b;
    am_buf_init(&b);
    am_buf_json_string(&b, "a\"b\\c\n\x01", 7);
    EXPECT(strcmp((char *)b.data, "\"a\\\"b\\\\c\\u000a\\u0001\"") == 0);
    am_buf_free(&b);
}

static unsigned lines_seen;
static char last_line[256];

static void keep_line(void *ctx, const char *line, size_t len) {
    (void)ctx;
    lines_seen++;
    snprintf(last_line, sizeof last_line, "%.*s", (int)len, line);
}

static void test_agent_lines(void) {
    am_lines lines;
    am_lines_init(&lines);
    am_lines_feed(&lines, "{\"a\":1}\n{\"b\"", 12, keep_line, NULL);
    EXPECT(lines_seen == 1 && strcmp(last_line, "{\"a\":1}") == 0);
    am_lines_feed(&lines, ":2}\n", 4, keep_line, NULL);
    EXPECT(lines_seen == 2 && strcmp(last_line, "{\"b\":2}") == 0);
    am_lines_feed(&lines, "partial\xff{\"c\":3}\n", 17, keep_line, NULL);    /* a resync drops "partial" */
    EXPECT(lines_seen == 3 && strcmp(last_line, "{\"c\":3}") == 0);
    char *big = malloc(AM_AGENT_MAX_LINE + 10);
    memset(big, 'x', AM_AGENT_MAX_LINE + 10);
    am_lines_feed(&lines, big, AM_AGENT_MAX_LINE + 10, keep_line, NULL);  /* over the bound: dropped to its newline */
    am_lines_feed(&lines, "yy\n{}\n", 6, keep_line, NULL);
    EXPECT(lines_seen == 4 && strcmp(last_line, "{}") == 0 && lines.dropped == 1);
    free(big);
    am_lines_free(&lines);

    am_agent_message m;
    const char *resume = "{\"type\":\"resume\",\"id\":7,\"sid\":\"s-1\",\"endpoint\":\"[::1]:7070\",\"ticket\":\"v1.t\"}";
    am_agent_parse(resume, strlen(resume), "s-1", &m);
    EXPECT(m.kind == AM_AGENT_RESUME && m.id == 7 && strcmp(m.endpoint, "[::1]:7070") == 0 &&
           strcmp(m.ticket, "v1.t") == 0);
    am_agent_message_free(&m);
    const char *other = "{\"type\":\"resume\",\"id\":8,\"sid\":\"s-2\"}";
    am_agent_parse(other, strlen(other), "s-1", &m);          /* another connection's session */
    EXPECT(m.kind == AM_AGENT_BAD && strstr(m.error.message, "sid is not the session") != NULL);
    am_agent_message_free(&m);
    const char *no_id = "{\"type\":\"prove\",\"host\":\"h\",\"challenges\":{\"0123abcd\":\"00112233445566778899\"}}";
    am_agent_parse(no_id, strlen(no_id), "s-1", &m);          /* no answer could be told apart: none */
    EXPECT(m.kind == AM_AGENT_OTHER);
    am_agent_message_free(&m);
    const char *bad_challenge = "{\"type\":\"prove\",\"id\":9,\"host\":\"h\",\"challenges\":{\"0123abcd\":\"ABCD\"}}";
    am_agent_parse(bad_challenge, strlen(bad_challenge), "s-1", &m);
    EXPECT(m.kind == AM_AGENT_BAD);
    am_agent_message_free(&m);
    const char *bad_endpoint = "{\"type\":\"resume\",\"id\":10,\"endpoint\":\"no port\"}";
    am_agent_parse(bad_endpoint, strlen(bad_endpoint), "s-1", &m);
    EXPECT(m.kind == AM_AGENT_BAD && strstr(m.error.message, "endpoint") != NULL);
    am_agent_message_free(&m);
    const char *junk = "{\"type\":\"result\"} trailing";
    am_agent_parse(junk, strlen(junk), "s-1", &m);
    EXPECT(m.kind == AM_AGENT_OTHER && m.message == NULL);
    am_agent_message_free(&m);
    const char *registered = "{\"type\":\"result\",\"id\":1,\"ok\":true,\"result\":{\"registered\":\"s-1\"}}";
    am_agent_parse(registered, strlen(registered), "s-1", &m);
    EXPECT(m.kind == AM_AGENT_RESULT && m.registered);
    am_agent_message_free(&m);

    am_buf out;
    am_buf_init(&out);
    am_error err;
    am_error_set(&err, "CONFLICT", "a \"quoted\"\nmessage");
    EXPECT(am_agent_result_error(&out, 5, &err) == 0 &&
           strcmp((char *)out.data, "{\"type\":\"result\",\"id\":5,\"ok\":false,\"error\":{\"code\":\"CONFLICT\","
                                    "\"message\":\"a \\\"quoted\\\"\\u000amessage\"}}\n") == 0);
    am_buf_free(&out);
}

static void test_includes(void) {
    am_buf out, options;
    am_buf_init(&out);
    am_buf_init(&options);
    char why[128];
    am_header headers[1] = {{"pi.h", "#pragma once\nfloat pi(void) { return 3.14f; }", 45}};
    const char *source = "#include \"pi.h\"\n  #  include <pi.h>\nkernel void k(void) {}\n#include \"nowhere.h\"\n";
    EXPECT(am_expand_includes(source, strlen(source), "-DX=1 -I /nonexistent -I\"/also nothing\" -w", headers, 1, &out,
                              &options, why, sizeof why) == 0);
    const char *text = (const char *)out.data;
    EXPECT(strstr(text, "float pi(void)") != NULL && strstr(strstr(text, "float pi(void)") + 1, "float pi(void)") == NULL);
    EXPECT(strstr(text, "#line 1 \"pi.h\"") != NULL && strstr(text, "#line 2 \"input.cl\"") != NULL);
    EXPECT(strstr(text, "#include \"nowhere.h\"") != NULL);   /* not found: the compiler says so */
    EXPECT(strcmp((char *)options.data, "-DX=1    -w") == 0);   /* the -I it read do not travel */
    am_buf_free(&out);
    am_buf_free(&options);
    am_buf_init(&out);
    am_buf_init(&options);
    am_header loop[1] = {{"self.h", "#include \"self.h\"\n", 18}};   /* no guard: nested past the bound */
    EXPECT(am_expand_includes("#include \"self.h\"", 17, "", loop, 1, &out, &options, why, sizeof why) == -1 &&
           strstr(why, "nested") != NULL);
    am_buf_free(&out);
    am_buf_free(&options);
    am_buf defines, undefines, rest;
    am_buf_init(&defines);
    am_buf_init(&undefines);
    am_buf_init(&rest);
    EXPECT(am_split_defines("-D A=1 -DB -cl-fast-relaxed-math", &defines, &undefines, &rest) == 0);
    EXPECT(strcmp((char *)defines.data, "#define A 1\n#define B 1\n") == 0 &&
           strcmp((char *)undefines.data, "#undef A\n#undef B\n") == 0 &&
           strcmp((char *)rest.data, "-cl-fast-relaxed-math") == 0);
    am_buf_free(&defines);
    am_buf_free(&undefines);
    am_buf_free(&rest);
}

static int hex_decode(const char *hex, unsigned char *out, size_t size) {
    size_t n = strlen(hex) / 2;
    if (n > size)
        return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (unsigned char)v;
    }
    return (int)n;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "params") == 0) {
        for (size_t i = 0; i < AM_DEVICE_PARAM_COUNT; i++)
            printf("%s %#x %s\n", AM_DEVICE_PARAMS[i].name, AM_DEVICE_PARAMS[i].code,
                   am_param_kind_name(AM_DEVICE_PARAMS[i].kind));
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "config") == 0) {
        /* the configuration file's keys as this driver reads them (tests compare wire.driverconfig's) */
        FILE *f = fopen(argv[2], "rb");
        static char text[70000];
        size_t len = f != NULL ? fread(text, 1, sizeof text, f) : 0;
        if (f != NULL)
            fclose(f);
        am_config cfg;
        am_error err;
        am_config_defaults(&cfg);
        if (am_config_parse(&cfg, text, len, argv[2], &err) != 0) {
            printf("refused\n");
            return 0;
        }
        printf("endpoint=%s\ntoken=%s\ntoken_file=%s\ncafile=%s\ninsecure=%d\ntimeout=%g\nconnect_timeout=%g\n",
               cfg.endpoint, cfg.token, cfg.token_file, cfg.cafile, cfg.insecure, cfg.timeout, cfg.connect_timeout);
        return 0;
    }
    if (argc == 7 && strcmp(argv[1], "proof") == 0) {
        unsigned char secret[64], binding[256];
        int secret_len = hex_decode(argv[2], secret, sizeof secret);
        int binding_len = hex_decode(argv[6], binding, sizeof binding);
        if (secret_len < 0 || binding_len < 0)
            return 2;
        char proof[65];
        am_ownership_proof(secret, (size_t)secret_len, argv[3], argv[4], strtoull(argv[5], NULL, 10), binding,
                           (size_t)binding_len, proof);
        printf("%s\n", proof);
        return 0;
    }
    if (argc == 8 && strcmp(argv[1], "bind") == 0) {
        unsigned char secret[64];
        int secret_len = hex_decode(argv[2], secret, sizeof secret);
        if (secret_len < 0)
            return 2;
        char proof[65];
        am_bind_proof(secret, (size_t)secret_len, argv[3], argv[4], argv[5], argv[6], argv[7], proof);
        printf("%s\n", proof);
        return 0;
    }
    test_frames();
    test_agent_lines();
    test_includes();
    test_dispatch();
    test_window();
    test_rects();
    test_config();
    test_params();
    test_json_and_text();
    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}

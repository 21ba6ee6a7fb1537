#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "log.h"

#define MAX_CONFIG_FILE (64 * 1024)

void am_config_defaults(am_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->insecure = -1;
    cfg->timeout = 60.0;
    cfg->connect_timeout = 10.0;
    snprintf(cfg->agent_socket, sizeof cfg->agent_socket, "%s", AM_DEFAULT_AGENT_SOCKET);
    cfg->window_commands = 4096;
    cfg->window_bytes = 512ull << 20;
}

static int copy_text(char *dst, size_t size, const char *value, size_t len, const char *key, const char *source,
                     am_error *err) {
    if (len >= size || memchr(value, 0, len) != NULL) {
        am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: %s is too long or holds a NUL",
                     source, key);
        return -1;
    }
    memcpy(dst, value, len);
    dst[len] = 0;
    return 0;
}

static int parse_bool(const char *value, size_t len, int *out) {
    if (len == 4 && memcmp(value, "true", 4) == 0)
        return *out = 1, 0;
    if (len == 5 && memcmp(value, "false", 5) == 0)
        return *out = 0, 0;
    return -1;
}

static int parse_seconds(const char *value, size_t len, double *out) {
    char text[32];
    if (len == 0 || len >= sizeof text)
        return -1;
    memcpy(text, value, len);
    text[len] = 0;
    char *end = NULL;
    errno = 0;
    double seconds = strtod(text, &end);
    if (errno != 0 || end == text || *end != 0 || !(seconds > 0.0 && seconds <= 86400.0))
        return -1;
    *out = seconds;
    return 0;
}

/* One "quoted string" value (TOML basic string: \" \\ \n \t escapes) into
 * `out`; -1 if it is not one. */
static int unquote(const char *value, size_t len, char *out, size_t out_size, size_t *out_len) {
    if (len < 2 || value[0] != '"' || value[len - 1] != '"')
        return -1;
    size_t n = 0;
    for (size_t i = 1; i + 1 < len; i++) {
        char c = value[i];
        if (c == '"')
            return -1;
        if (c == '\\') {
            if (i + 2 >= len)
                return -1;
            char e = value[++i];
            c = e == 'n' ? '\n' : e == 't' ? '\t' : e == '"' ? '"' : e == '\\' ? '\\' : 0;
            if (c == 0)
                return -1;
        }
        if ((unsigned char)c < 0x20 && c != '\t' && c != '\n')
            return -1;
        if (n + 1 >= out_size)
            return -1;
        out[n++] = c;
    }
    out[n] = 0;
    *out_len = n;
    return 0;
}

static const char *trim(const char *start, const char *end, size_t *len) {
    while (start < end && (*start == ' ' || *start == '\t'))
        start++;
    while (end > start && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    *len = (size_t)(end - start);
    return start;
}

int am_config_parse(am_config *cfg, const char *text, size_t len, const char *source, am_error *err) {
    const char *p = text, *end = text + len;
    int line_no = 0;
    bool in_driver = true; /* keys at the top, or in [driver] */
    if (len > MAX_CONFIG_FILE) {
        am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: over %d bytes", source, MAX_CONFIG_FILE);
        return -1;
    }
    /* a value is never longer than its line, nor than the file */
    char *value_text = malloc(len + 1);
    if (value_text == NULL) {
        am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: out of memory", source);
        return -1;
    }
    int result = 0;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *line_end = nl != NULL ? nl : end;
        line_no++;
        size_t line_len;
        const char *line = trim(p, line_end, &line_len);
        p = nl != NULL ? nl + 1 : end;
        if (line_len == 0 || line[0] == '#')
            continue;
        if (line[0] == '[') {
            in_driver = line_len == 8 && memcmp(line, "[driver]", 8) == 0;
            continue;
        }
        const char *eq = memchr(line, '=', line_len);
        if (eq == NULL) {
            am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: line %d is not key = value",
                         source, line_no);
            result = -1;
            break;
        }
        size_t key_len, raw_len;
        const char *key = trim(line, eq, &key_len);
        const char *raw = trim(eq + 1, line + line_len, &raw_len);
        /* a comment after a value that is no string */
        if (raw_len > 0 && raw[0] != '"') {
            const char *hash = memchr(raw, '#', raw_len);
            if (hash != NULL)
                raw = trim(raw, hash, &raw_len);
        } else if (raw_len > 1) {
            const char *close = memchr(raw + 1, '"', raw_len - 1);
            while (close != NULL && close[-1] == '\\' && close + 1 < raw + raw_len)
                close = memchr(close + 1, '"', (size_t)(raw + raw_len - close - 1));
            if (close != NULL)
                raw = trim(raw, close + 1, &raw_len);
        }
        if (!in_driver)
            continue;
        size_t value_len = 0;
        bool quoted = unquote(raw, raw_len, value_text, len + 1, &value_len) == 0;
#define KEY(name) (key_len == sizeof(name) - 1 && memcmp(key, name, key_len) == 0)
        int rc = 0;
        if (KEY("endpoint") && quoted)
            rc = copy_text(cfg->endpoint, sizeof cfg->endpoint, value_text, value_len, "endpoint", source, err);
        else if (KEY("token") && quoted)
            rc = copy_text(cfg->token, sizeof cfg->token, value_text, value_len, "token", source, err);
        else if (KEY("token_file") && quoted)
            rc = copy_text(cfg->token_file, sizeof cfg->token_file, value_text, value_len, "token_file", source, err);
        else if (KEY("cafile") && quoted)
            rc = copy_text(cfg->cafile, sizeof cfg->cafile, value_text, value_len, "cafile", source, err);
        else if (KEY("insecure") && !quoted)
            rc = parse_bool(raw, raw_len, &cfg->insecure);
        else if (KEY("timeout") && !quoted)
            rc = parse_seconds(raw, raw_len, &cfg->timeout);
        else if (KEY("connect_timeout") && !quoted)
            rc = parse_seconds(raw, raw_len, &cfg->connect_timeout);
        else if (KEY("endpoint") || KEY("token") || KEY("token_file") || KEY("cafile") || KEY("insecure") ||
                 KEY("timeout") || KEY("connect_timeout"))
            rc = -1;
        else
            am_warn("%s line %d: unknown key %.*s (ignored)", source, line_no, (int)(key_len > 40 ? 40 : key_len),
                    key);
#undef KEY
        if (rc != 0) {
            if (err->code[0] == 0 || strcmp(err->code, "CONFIG_INVALID") != 0)
                am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: line %d: %.*s has a value of "
                             "the wrong kind (strings in quotes, true/false, seconds)",
                             source, line_no, (int)(key_len > 40 ? 40 : key_len), key);
            result = -1;
            break;
        }
    }
    free(value_text);
    return result;
}

static int read_small_file(const char *path, char *out, size_t size, size_t *len, bool *present) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    *present = fd >= 0 || errno != ENOENT;
    if (fd < 0)
        return -1;
    size_t n = 0;
    for (;;) {
        if (n == size) {
            close(fd);
            return -1;
        }
        ssize_t got = read(fd, out + n, size - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            close(fd);
            return -1;
        }
        if (got == 0)
            break;
        n += (size_t)got;
    }
    close(fd);
    *len = n;
    return 0;
}

int am_domain_claim(const char *text, size_t len, char out[40]) {
    while (len > 0 && (text[0] == ' ' || text[0] == '\t' || text[0] == '\n' || text[0] == '\r')) {
        text++;
        len--;
    }
    while (len > 0 && (text[len - 1] == ' ' || text[len - 1] == '\t' || text[len - 1] == '\n' ||
                       text[len - 1] == '\r'))
        len--;
    if (len != 36)
        return -1;
    for (size_t i = 0; i < 36; i++) {
        char c = text[i];
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (c != '-')
                return -1;
            out[i] = '-';
            continue;
        }
        if (c >= 'A' && c <= 'F')
            c = (char)(c - 'A' + 'a');
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return -1;
        out[i] = c;
    }
    out[36] = 0;
    /* what firmware without a real UUID writes there (agent/dmi.py) */
    static const char *const placeholders[] = {"00000000-0000-0000-0000-000000000000",
                                               "ffffffff-ffff-ffff-ffff-ffffffffffff",
                                               "03000200-0400-0500-0006-000700080009"};
    for (size_t i = 0; i < sizeof placeholders / sizeof *placeholders; i++)
        if (strcmp(out, placeholders[i]) == 0) {
            out[0] = 0;
            return -1;
        }
    return 0;
}

/* The guest agent's answer to "where" ({"type":"where","id":1}): where the
 * pool is (it knows since the host told it) and which domain this guest
 * is.  Empty strings when no agent answers. */
static void ask_agent(const char *path, char *endpoint, size_t size, char domain[40]) {
    struct stat st;
    endpoint[0] = 0;
    domain[0] = 0;
    if (path[0] == 0 || stat(path, &st) != 0)
        return;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    char line[8192];
    size_t got = 0;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        goto done;
    static const char request[] = "{\"type\":\"where\",\"id\":1}\n";
    if (send(fd, request, sizeof request - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof request - 1))
        goto done;
    while (got < sizeof line - 1) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 2000) <= 0)
            goto done;
        ssize_t n = recv(fd, line + got, sizeof line - 1 - got, 0);
        if (n <= 0)
            goto done;
        got += (size_t)n;
        char *nl = memchr(line, '\n', got);
        if (nl == NULL)
            continue;
        json_object *answer = NULL;
        struct json_tokener *tok = json_tokener_new_ex(AM_JSON_MAX_DEPTH);
        if (tok != NULL) {
            json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
            answer = json_tokener_parse_ex(tok, line, (int)(nl - line));
            json_tokener_free(tok);
        }
        size_t len = 0;
        json_object *result = am_json_get(answer, "result");
        const char *where = am_json_str(result, "endpoint", &len);
        if (where != NULL && len > 0 && len < size && am_utf8_valid(where, len)) {
            memcpy(endpoint, where, len);
            endpoint[len] = 0;
        }
        const char *uuid = am_json_str(result, "domain", &len);
        if (uuid != NULL && am_domain_claim(uuid, len, domain) != 0)
            domain[0] = 0;
        json_object_put(answer);
        break;
    }
done:
    close(fd);
}

void am_agent_domain(const char *path, char *out, size_t size) {
    char endpoint[320], domain[40];
    ask_agent(path, endpoint, sizeof endpoint, domain);
    snprintf(out, size, "%s", domain);
}

/* The SMBIOS system UUID as Linux shows it (root only may read it). */
static void read_dmi(char domain[40]) {
    char text[80];
    size_t len = 0;
    bool present = false;
    domain[0] = 0;
    if (read_small_file("/sys/class/dmi/id/product_uuid", text, sizeof text, &len, &present) == 0 &&
        am_domain_claim(text, len, domain) != 0)
        domain[0] = 0;
}

int am_config_load(am_config *cfg, am_error *err) {
    am_config_defaults(cfg);
    const char *path = getenv("ACCELMIG_DRIVER_CONFIG");
    if (path == NULL || path[0] == 0)
        path = AM_DEFAULT_CONFIG;
    char *text = malloc(MAX_CONFIG_FILE + 1);
    if (text == NULL) {
        am_error_set(err, "CONFIG_INVALID", "out of memory reading the configuration");
        return -1;
    }
    size_t len = 0;
    bool present = false;
    if (read_small_file(path, text, MAX_CONFIG_FILE + 1, &len, &present) == 0) {
        snprintf(cfg->source, sizeof cfg->source, "%s", path);
        int rc = am_config_parse(cfg, text, len, path, err);
        free(text);
        if (rc != 0)
            return -1;
    } else if (present) {
        free(text);
        am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: cannot read it, or over %d bytes", path,
                     MAX_CONFIG_FILE);
        return -1;
    } else {
        free(text);
    }
    const char *value;
    if ((value = getenv("ACCELMIG_AGENT_SOCKET")) != NULL)
        snprintf(cfg->agent_socket, sizeof cfg->agent_socket, "%s", value);
    char from_agent[320] = "", agent_domain[40] = "";
    ask_agent(cfg->agent_socket, from_agent, sizeof from_agent, agent_domain);
    read_dmi(cfg->domain);
    if (cfg->domain[0] == 0)
        snprintf(cfg->domain, sizeof cfg->domain, "%s", agent_domain);
    if (from_agent[0] != 0)
        snprintf(cfg->endpoint, sizeof cfg->endpoint, "%s", from_agent);
    else if ((value = getenv("ACCELMIG_ENDPOINT")) != NULL && value[0] != 0)
        snprintf(cfg->endpoint, sizeof cfg->endpoint, "%s", value);
    if ((value = getenv("ACCELMIG_TOKEN")) != NULL && value[0] != 0) {
        if (strlen(value) > AM_MAX_TOKEN) {
            am_error_set(err, "CONFIG_INVALID", "invalid configuration in ACCELMIG_TOKEN: over %d bytes", AM_MAX_TOKEN);
            return -1;
        }
        snprintf(cfg->token, sizeof cfg->token, "%s", value);
    } else if (cfg->token[0] == 0 && cfg->token_file[0] != 0) {
        char token[AM_MAX_TOKEN + 2];
        size_t token_len = 0;
        bool there = false;
        if (read_small_file(cfg->token_file, token, AM_MAX_TOKEN + 1, &token_len, &there) != 0 ||
            token_len > AM_MAX_TOKEN) {
            am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: token_file %s cannot be read",
                         cfg->source, cfg->token_file);
            return -1;
        }
        while (token_len > 0 && (token[token_len - 1] == '\n' || token[token_len - 1] == '\r'))
            token_len--;
        memcpy(cfg->token, token, token_len);
        cfg->token[token_len] = 0;
    }
    if ((value = getenv("ACCELMIG_CAFILE")) != NULL && value[0] != 0)
        snprintf(cfg->cafile, sizeof cfg->cafile, "%s", value);
    if ((value = getenv("ACCELMIG_INSECURE")) != NULL && value[0] != 0)
        cfg->insecure = strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 || strcasecmp(value, "yes") == 0 ||
                        strcasecmp(value, "on") == 0;
    if ((value = getenv("ACCELMIG_TIMEOUT")) != NULL && value[0] != 0 &&
        parse_seconds(value, strlen(value), &cfg->timeout) != 0) {
        am_error_set(err, "CONFIG_INVALID", "invalid configuration in ACCELMIG_TIMEOUT: %.40s is no number of "
                     "seconds", value);
        return -1;
    }
    if (cfg->insecure == 1 && cfg->cafile[0] != 0 && getenv("ACCELMIG_CAFILE") != NULL &&
        getenv("ACCELMIG_INSECURE") != NULL) {
        am_error_set(err, "CONFIG_INVALID", "invalid configuration: ACCELMIG_INSECURE and ACCELMIG_CAFILE both "
                     "given: choose one");
        return -1;
    }
    return 0;
}

int am_config_ready(const am_config *cfg, am_error *err) {
    if (cfg->endpoint[0] == 0) {
        am_error_set(err, "UNAVAILABLE", "the pool's endpoint is unknown: no guest agent knows one, "
                     "ACCELMIG_ENDPOINT is unset, and %s names none",
                     cfg->source[0] ? cfg->source : AM_DEFAULT_CONFIG " (absent)");
        return -1;
    }
    if (cfg->token[0] == 0) {
        am_error_set(err, "CONFIG_INVALID", "no tenant token: ACCELMIG_TOKEN is unset and %s gives no token "
                     "or token_file", cfg->source[0] ? cfg->source : AM_DEFAULT_CONFIG " (absent)");
        return -1;
    }
    return 0;
}

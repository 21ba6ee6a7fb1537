#include "includes.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* -- options ------------------------------------------------------------------------------ */

typedef struct token {
    size_t start, end;          /* in the options' text */
    char *text;                 /* owned: unquoted */
} token;

typedef struct tokens {
    token *items;
    size_t count, cap;
} tokens;

static void tokens_free(tokens *t) {
    for (size_t i = 0; i < t->count; i++)
        free(t->items[i].text);
    free(t->items);
    memset(t, 0, sizeof *t);
}

/* Split as a shell would (whitespace; '...' and "..." quote, \ escapes in "..."). */
static int tokenize(const char *options, tokens *out) {
    memset(out, 0, sizeof *out);
    size_t i = 0, n = strlen(options);
    while (i < n) {
        while (i < n && isspace((unsigned char)options[i]))
            i++;
        if (i == n)
            break;
        am_buf text;
        am_buf_init(&text);
        size_t start = i;
        int rc = 0;
        while (i < n && !isspace((unsigned char)options[i])) {
            char c = options[i];
            if (c == '\'' || c == '"') {
                i++;
                while (i < n && options[i] != c) {
                    if (c == '"' && options[i] == '\\' && i + 1 < n)
                        i++;
                    rc |= am_buf_append(&text, options + i, 1);
                    i++;
                }
                i += i < n; /* (the closing quote) */
                continue;
            }
            rc |= am_buf_append(&text, &c, 1);
            i++;
        }
        rc |= am_buf_append(&text, "", 1);
        if (rc == 0 && out->count == out->cap) {
            size_t cap = out->cap ? out->cap * 2 : 16;
            token *more = realloc(out->items, cap * sizeof *more);
            if (more == NULL)
                rc = -1;
            else
                out->items = more, out->cap = cap;
        }
        if (rc != 0) {
            am_buf_free(&text);
            tokens_free(out);
            return -1;
        }
        out->items[out->count++] = (token){start, i, (char *)text.data};
    }
    return 0;
}

/* -- the expansion -------------------------------------------------------------------------- */

typedef struct expander {
    const am_header *headers;
    size_t num_headers;
    const char **dirs;
    size_t num_dirs;
    am_buf *out;
    char **once;                 /* headers with #pragma once put in already (their keys) */
    size_t num_once, cap_once;
    char *why;
    size_t why_len;
} expander;

static int fail(expander *e, const char *what, const char *name) {
    snprintf(e->why, e->why_len, "%s: %.200s", what, name);
    return -1;
}

static int put(expander *e, const void *data, size_t len) {
    if (e->out->len + len > AM_INCLUDE_BYTES)
        return fail(e, "the source with its headers is over 16 MiB", "");
    return am_buf_append(e->out, data, len) == 0 ? 0 : fail(e, "out of memory", "");
}

/* A #line directive's file name, quoted for it. */
static int put_line(expander *e, size_t line, const char *name) {
    char head[32];
    snprintf(head, sizeof head, "#line %zu \"", line);
    if (put(e, head, strlen(head)) != 0)
        return -1;
    for (const char *p = name; *p; p++) {
        if ((*p == '"' || *p == '\\') && put(e, "\\", 1) != 0)
            return -1;
        if ((unsigned char)*p >= 0x20 && put(e, p, 1) != 0)
            return -1;
    }
    return put(e, "\"\n", 2);
}

/* `#include "name"` or `#include <name>` alone on its line: the name (into
 * `name`) and whether it was quoted; false for anything else. */
static bool include_line(const char *line, size_t len, char *name, size_t size, bool *quoted) {
    size_t i = 0;
    while (i < len && (line[i] == ' ' || line[i] == '\t'))
        i++;
    if (i == len || line[i] != '#')
        return false;
    i++;
    while (i < len && (line[i] == ' ' || line[i] == '\t'))
        i++;
    if (len - i < 7 || memcmp(line + i, "include", 7) != 0)
        return false;
    i += 7;
    while (i < len && (line[i] == ' ' || line[i] == '\t'))
        i++;
    if (i == len || (line[i] != '"' && line[i] != '<'))
        return false;
    char close = line[i] == '"' ? '"' : '>';
    *quoted = close == '"';
    size_t start = ++i;
    while (i < len && line[i] != close)
        i++;
    if (i == len || i == start || i - start >= size)
        return false;
    memcpy(name, line + start, i - start);
    name[i - start] = 0;
    return memchr(name, 0, i - start) == NULL;
}

static bool has_pragma_once(const char *text, size_t len) {
    for (size_t i = 0; i < len;) {
        const char *eol = memchr(text + i, '\n', len - i);
        size_t end = eol != NULL ? (size_t)(eol - text) : len;
        size_t j = i;
        while (j < end && (text[j] == ' ' || text[j] == '\t'))
            j++;
        if (j < end && text[j] == '#') {
            j++;
            while (j < end && (text[j] == ' ' || text[j] == '\t'))
                j++;
            if (end - j >= 6 && memcmp(text + j, "pragma", 6) == 0) {
                j += 6;
                while (j < end && (text[j] == ' ' || text[j] == '\t'))
                    j++;
                if (end - j >= 4 && memcmp(text + j, "once", 4) == 0)
                    return true;
            }
        }
        i = end + 1;
    }
    return false;
}

/* A regular file's text (at most AM_INCLUDE_BYTES), or NULL. */
static char *read_file(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return NULL;
    struct stat st;
    char *text = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size <= AM_INCLUDE_BYTES &&
        (text = malloc((size_t)st.st_size + 1)) != NULL) {
        size_t got = 0;
        while (got < (size_t)st.st_size) {
            ssize_t n = read(fd, text + got, (size_t)st.st_size - got);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        text[got] = 0;
        *len = got;
    }
    close(fd);
    return text;
}

static bool seen_once(expander *e, const char *key) {
    for (size_t i = 0; i < e->num_once; i++)
        if (strcmp(e->once[i], key) == 0)
            return true;
    return false;
}

static int remember_once(expander *e, const char *key) {
    if (e->num_once == e->cap_once) {
        size_t cap = e->cap_once ? e->cap_once * 2 : 8;
        char **more = realloc(e->once, cap * sizeof *more);
        if (more == NULL)
            return -1;
        e->once = more;
        e->cap_once = cap;
    }
    return (e->once[e->num_once] = strdup(key)) != NULL ? (e->num_once++, 0) : -1;
}

static int expand(expander *e, const char *text, size_t len, const char *name, const char *dir, int depth);

/* dir/name, unless that is too long for `out` (then nothing is looked for there) */
static bool joined(char *out, size_t size, const char *dir, const char *name) {
    int n = snprintf(out, size, "%s/%s", dir, name);
    return n > 0 && (size_t)n < size;
}

/* Put the header `wanted` in, if found; *found says whether it was. */
static int include(expander *e, const char *wanted, bool quoted, const char *dir, int depth, bool *found) {
    *found = false;
    const char *text = NULL;
    size_t len = 0;
    char *owned = NULL;
    char key[4300], path[4200];
    for (size_t i = 0; i < e->num_headers && text == NULL; i++)
        if (strcmp(e->headers[i].name, wanted) == 0) {
            text = e->headers[i].text;
            len = e->headers[i].len;
            snprintf(key, sizeof key, "header:%s", wanted);
            snprintf(path, sizeof path, "%s", wanted);
        }
    if (text == NULL && wanted[0] == '/' && (owned = read_file(wanted, &len)) != NULL) {
        snprintf(path, sizeof path, "%s", wanted);
    }
    if (text == NULL && owned == NULL && quoted && dir != NULL && joined(path, sizeof path, dir, wanted))
        owned = read_file(path, &len);
    for (size_t i = 0; i < e->num_dirs && text == NULL && owned == NULL && wanted[0] != '/'; i++)
        if (joined(path, sizeof path, e->dirs[i], wanted))
            owned = read_file(path, &len);
    if (owned != NULL) {
        text = owned;
        snprintf(key, sizeof key, "file:%s", path);
    }
    if (text == NULL)
        return 0;
    *found = true;
    if (depth + 1 > AM_INCLUDE_DEPTH) {
        free(owned);
        return fail(e, "headers nested over 32 deep at", wanted);
    }
    int rc = 0;
    bool once = has_pragma_once(text, len);
    if (!once || !seen_once(e, key)) {
        if (once && remember_once(e, key) != 0)
            rc = fail(e, "out of memory", "");
        char header_dir[4200];
        snprintf(header_dir, sizeof header_dir, "%s", path);
        char *slash = strrchr(header_dir, '/');
        if (slash != NULL)
            *slash = 0;
        if (rc == 0)
            rc = expand(e, text, len, path, owned != NULL && slash != NULL ? header_dir : dir, depth + 1);
    }
    free(owned);
    return rc;
}

static int expand(expander *e, const char *text, size_t len, const char *name, const char *dir, int depth) {
    size_t line_no = 1;
    if (depth > 0 && put_line(e, 1, name) != 0)
        return -1;
    for (size_t i = 0; i < len; line_no++) {
        const char *eol = memchr(text + i, '\n', len - i);
        size_t end = eol != NULL ? (size_t)(eol - text) : len;
        char wanted[4096];
        bool quoted, found = false;
        if (include_line(text + i, end - i, wanted, sizeof wanted, &quoted)) {
            if (include(e, wanted, quoted, dir, depth, &found) != 0)
                return -1;
            if (found && put_line(e, line_no + 1, name) != 0)
                return -1;
        }
        if (!found && (put(e, text + i, end - i) != 0 || put(e, "\n", 1) != 0))
            return -1;
        i = end + 1;
    }
    return 0;
}

int am_expand_includes(const char *source, size_t len, const char *options, const am_header *headers,
                       size_t num_headers, am_buf *out, am_buf *out_options, char *why, size_t why_len) {
    why[0] = 0;
    tokens t;
    if (tokenize(options, &t) != 0) {
        snprintf(why, why_len, "out of memory");
        return -1;
    }
    const char **dirs = calloc(t.count + 1, sizeof *dirs);
    bool *dropped = calloc(t.count + 1, sizeof *dropped);
    size_t num_dirs = 0;
    int rc = dirs != NULL && dropped != NULL ? 0 : -1;
    for (size_t i = 0; i < t.count && rc == 0; i++) {
        const char *tok = t.items[i].text;
        if (strcmp(tok, "-I") == 0 && i + 1 < t.count) {
            dirs[num_dirs++] = t.items[i + 1].text;
            dropped[i] = dropped[i + 1] = true;
            i++;
        } else if (strncmp(tok, "-I", 2) == 0 && tok[2] != 0) {
            dirs[num_dirs++] = tok + 2;
            dropped[i] = true;
        }
    }
    /* the options as they were, less the -I the driver reads itself */
    size_t at = 0;
    for (size_t i = 0; i < t.count && rc == 0; i++) {
        if (!dropped[i])
            continue;
        rc |= am_buf_append(out_options, options + at, t.items[i].start - at);
        at = t.items[i].end;
    }
    if (rc == 0)
        rc = am_buf_append(out_options, options + at, strlen(options) - at) | am_buf_append(out_options, "", 1);
    if (rc == 0)
        out_options->len--; /* (a terminated string; its NUL not counted) */
    if (rc != 0)
        snprintf(why, why_len, "out of memory");
    expander e = {headers, num_headers, dirs, num_dirs, out, NULL, 0, 0, why, why_len};
    if (rc == 0)
        rc = expand(&e, source, len, "input.cl", NULL, 0);
    if (rc == 0 && am_buf_append(out, "", 1) == 0)
        out->len--;
    for (size_t i = 0; i < e.num_once; i++)
        free(e.once[i]);
    free(e.once);
    free(dirs);
    free(dropped);
    tokens_free(&t);
    return rc;
}

int am_split_defines(const char *options, am_buf *defines, am_buf *undefines, am_buf *rest) {
    tokens t;
    if (tokenize(options, &t) != 0)
        return -1;
    int rc = 0;
    for (size_t i = 0; i < t.count && rc == 0; i++) {
        const char *tok = t.items[i].text, *define = NULL;
        if (strcmp(tok, "-D") == 0 && i + 1 < t.count)
            define = t.items[++i].text;
        else if (strncmp(tok, "-D", 2) == 0 && tok[2] != 0)
            define = tok + 2;
        if (define == NULL) {
            rc |= am_buf_append(rest, " ", rest->len ? 1 : 0);
            rc |= am_buf_append(rest, options + t.items[i].start, t.items[i].end - t.items[i].start);
            continue;
        }
        const char *equals = strchr(define, '=');
        size_t name_len = equals != NULL ? (size_t)(equals - define) : strlen(define);
        if (name_len == 0 || memchr(define, '\n', strlen(define)) != NULL)
            continue; /* (nothing a #define line can say) */
        rc |= am_buf_puts(defines, "#define ");
        rc |= am_buf_append(defines, define, name_len);
        rc |= am_buf_puts(defines, " ");
        rc |= am_buf_puts(defines, equals != NULL ? equals + 1 : "1");
        rc |= am_buf_puts(defines, "\n");
        rc |= am_buf_puts(undefines, "#undef ");
        rc |= am_buf_append(undefines, define, name_len);
        rc |= am_buf_puts(undefines, "\n");
    }
    rc |= am_buf_append(rest, "", 1);
    if (rc == 0)
        rest->len--;
    tokens_free(&t);
    return rc;
}

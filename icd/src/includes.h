/* Kernel sources' #include directives, resolved on the application's side.
 *
 * The pool's compiler runs where none of the application's files are (and
 * must read none of the pool's: pool/devices/sandbox.py), so the driver
 * puts each header the source includes into the source itself, as the
 * application's own compiler would find it: a header clCompileProgram
 * names (input_headers), then, for "name", the including file's
 * directory, then each -I directory of the options in order (-I options
 * the driver used do not travel to the pool: the application's paths are
 * its own).  A header that is not found stays a directive (the compiler
 * then says it is missing, in the build log).  #line directives keep the
 * build log's lines and names right; a header with `#pragma once` is put
 * in once.
 *
 * Written by hand: this is the part of a C preprocessor no library offers
 * alone (cpp would also expand macros, which the device compiler must see
 * unexpanded).  Limits: a directive is recognised on its own line, not
 * inside a block comment or behind a line continuation, and an include
 * inside a branch that is not taken is still resolved (harmless: its text
 * stays inside that branch); a computed include (#include MACRO) stays as
 * it is.  Bounded: at most AM_INCLUDE_DEPTH nested headers and
 * AM_INCLUDE_BYTES in all. */
#ifndef ACCELMIG_INCLUDES_H
#define ACCELMIG_INCLUDES_H

#include <stddef.h>

#include "buffer.h"

#define AM_INCLUDE_DEPTH 32
#define AM_INCLUDE_BYTES (16u << 20)

typedef struct am_header {
    const char *name;           /* as the source names it */
    const char *text;
    size_t len;
} am_header;

/* `source` with its includes put in (`out`), and `options` without the -I
 * the driver read (`out_options`).  0, or -1 and why (`why`): out of
 * memory, nested too deep, past AM_INCLUDE_BYTES. */
int am_expand_includes(const char *source, size_t len, const char *options, const am_header *headers,
                       size_t num_headers, am_buf *out, am_buf *out_options, char *why, size_t why_len);

/* The -D options of `options` as #define lines (`defines`) and their
 * #undef lines (`undefines`), and the other options (`rest`): a unit of a
 * link keeps its own macros. 0 or -1 (out of memory). */
int am_split_defines(const char *options, am_buf *defines, am_buf *undefines, am_buf *rest);

#endif

"""What a tenant's program build may ask of the pool node's compiler.

A build runs the device compiler (clang inside PoCL, a vendor's) on the pool
node: ``#include "/etc/accelmig/tokens.toml"`` would read the node's files
into the build log, and options such as ``-I``, ``-include`` or ``@file``
reach the file system too.  So a program is one self-contained source: no
file-reading directive, and only options from a list that touch no file.
Checked before the compiler sees anything (every backend, isolated or not).
"""

from __future__ import annotations

import re

from accelmig.wire.errors import BadRequest

#: directives that read a file: #include and its relatives, in any spelling
#: the preprocessor accepts (the digraph %: and the trigraph ??= for #),
#: and __has_include, which probes for one
_FILE_DIRECTIVE = re.compile(
    r"(?m)^[ \t]*(?:#|%:|\?\?=)[ \t]*(include|include_next|import|embed)\b|__has_include(?:_next)?\b")

#: options that touch no file: macros, the -cl-* switches, warnings
_ALLOWED_OPTION = re.compile(
    r"^(?:-D[A-Za-z_][A-Za-z0-9_]*(?:=\S*)?|-U[A-Za-z_][A-Za-z0-9_]*|-cl-[a-z0-9-]+(?:=[A-Za-z0-9.]+)?"
    r"|-w|-Werror|-g|-O[0-3s]?)$")


def _splice_lines(source: str) -> str:
    """Backslash-newline joins lines before directives are recognised."""
    return re.sub(r"\\\r?\n", "", source.replace("??/\n", "\n"))


def check_source(source: str, max_bytes: int) -> None:
    nbytes = len(source.encode("utf-8", "surrogatepass"))
    if nbytes > max_bytes:
        raise BadRequest(reason=f"program source of {nbytes} bytes is over the pool's limit of "
                                f"{max_bytes} (max_source_bytes)")
    match = _FILE_DIRECTIVE.search(_splice_lines(source))
    if match:
        word = match.group(1) or "__has_include"
        raise BadRequest(reason=f"program source uses {word}: a program on a shared pool is one "
                                f"self-contained source (nothing is read from the pool node's files)")


def check_options(options: str, what: str = "build") -> None:
    if len(options) > 4096:
        raise BadRequest(reason=f"{what} options of {len(options)} characters (4096 at most)")
    words = options.split()
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-D", "-U") and i + 1 < len(words):   # "-D NAME=1": the same, spaced
            word, i = word + words[i + 1], i + 1
        if not _ALLOWED_OPTION.match(word):
            raise BadRequest(reason=f"{what} option {word[:60]!r} is not allowed on a shared pool "
                                    f"(-D, -U, -cl-*, -w, -Werror, -g, -O are; nothing that names a file)")
        i += 1

"""Landlock (Linux 5.13+): a process restricts its own file and network access.

The device process's sandbox (``accelmig.pool.devices.sandbox``) uses it
as its second layer, behind the mount namespace: should a path of the
node's ever become visible in the sandbox, it still cannot be opened.

Written by hand over ``syscall(2)``: the standard library has no binding,
and the one package on PyPI (``landlock``) is a pre-release; the ABI is
three system calls and two small structures (``linux/landlock.h``), the
same numbers on every architecture.
"""

from __future__ import annotations

import ctypes
import os

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# File-system rights by the ABI version that introduced them.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER = 1 << 13            # ABI 2
TRUNCATE = 1 << 14         # ABI 3
IOCTL_DEV = 1 << 15        # ABI 5
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
_FS_LATEST = (1 << 16) - 1  # ABI 5 and later

# Network rights (ABI 4) and scopes (ABI 6).
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

#: what a tenant may do in a directory of its own
WRITABLE = (WRITE_FILE | READ_FILE | READ_DIR | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG
            | MAKE_SOCK | MAKE_FIFO | MAKE_SYM | REFER | TRUNCATE)
READABLE = READ_FILE | READ_DIR


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1                 # __attribute__((packed)) in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _call(number: int, *args) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def abi() -> int:
    """The Landlock ABI version this kernel offers; 0: none (not built in,
    not enabled at boot, or refused)."""
    try:
        return _call(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except OSError:
        return 0


class Ruleset:
    """What the process may still do once ``restrict`` is called: every
    right this ABI knows is handled (so denied), except where a rule
    grants it beneath a path; TCP is denied outright (ABI 4+); signals
    and abstract unix sockets reach only this process's own domain (ABI 6+)."""

    def __init__(self, version: int):
        if version < 1:
            raise OSError(0, "this kernel has no Landlock")
        self.version = version
        self.fs_rights = _FS_BY_ABI.get(version, _FS_LATEST)
        attr = _RulesetAttr(self.fs_rights, NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 else 0,
                            SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0)
        # an older kernel refuses fields it does not know unless they are left out
        size = 24 if version >= 6 else 16 if version >= 4 else 8
        self.fd = _call(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))

    def allow(self, path: str, rights: int) -> None:
        """Grant ``rights`` (those this ABI knows) on ``path`` and beneath it.
        A file gets only the rights that apply to files."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not os.path.isdir(path):
                rights &= EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
            rule = _PathBeneathAttr(rights & self.fs_rights, fd)
            _call(_SYS_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(_RULE_PATH_BENEATH),
                  ctypes.byref(rule), ctypes.c_uint32(0))
        finally:
            os.close(fd)

    def restrict(self) -> None:
        """Enforce it on this thread and every thread and process it starts
        later (needs no_new_privs set first)."""
        try:
            _call(_SYS_RESTRICT_SELF, ctypes.c_int(self.fd), ctypes.c_uint32(0))
        finally:
            os.close(self.fd)

"""A tenant's build cannot read the pool node's files (issue 28, item 1).

A real pool process (``accelmig-pool serve``) with TLS and a client CA, its
tenants in a file on disk, real PoCL in real, confined device processes;
the driver a tenant runs.  The attack: ``#include`` a file of the node and
read it back in the build log (``/**/#include "/etc/hostname"`` passed the
old deny-list, and clang quoted the file: ``unknown type name 'vm'``).

A generator of include spellings (comments, line continuations, macros
that expand to a path, ``#include`` through a macro, stringizing and token
pasting, trigraphs, digraphs, ``__has_include``, ``#include_next``,
``#import``, ``#embed``, ``-I``/``-isystem``/``-include``/``-imacros``/
``@file``/``--sysroot`` options, relative paths) against node paths that
exist, each beside a twin that does not: no build log or error ever holds
the secret marker the node's files hold, and each existing path's outcome
is its missing twin's (the paths' own text aside).  On the main branch of
before (no sandbox) it fails at once: the existing file's content is in
the log, its twin's is "file not found".
"""

from __future__ import annotations

import os
import re
import secrets
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelmig.agent.driver import connect
from accelmig.wire.errors import AccelmigError
from tests.support.processes import PoolProcess, hosts_toml

MARKER = "sEcReTmArKeR" + secrets.token_hex(6)
ADD = "__kernel void add(__global uint *a, uint n) { a[get_global_id(0)] += n; }"
TOKENS = {"alice": "alice-" + MARKER, "bob": "bob-token-sandbox-0001"}


def tenants_file() -> str:
    return "".join(f'[tenants.{name}]\ntoken = "{token}"\nquota = "64MiB"\n' for name, token in TOKENS.items())


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The pool node: its files (a secret of the test's own outside any
    sandbox, the tokens file, the TLS key) and a pool process serving TLS
    whose environment holds the marker too."""
    from accelmig.lab.certs import make_pki
    base = tmp_path_factory.mktemp("node")
    pki = make_pki(base / "pki", hosts=("hostA",))
    secret = base / "node-secret.h"
    # a first line clang would quote (``unknown type name '...'``)
    secret.write_text(f"{MARKER} leaked = 1;\n")
    pool = PoolProcess(base, tenants_file(), hosts_toml(hostA="hostA-sandbox-secret-0123"), tls=pki,
                       env={"ACCELMIG_NODE_SECRET": MARKER})
    try:
        yield {"pool": pool, "pki": pki, "secret": str(secret), "tokens": str(pool.tokens),
               "dir": str(base)}
    finally:
        pool.stop()


def tenant(node, name: str):
    return connect(node["pool"].endpoint, TOKENS[name], cafile=str(node["pki"].ca), agent=False, timeout=60)


@pytest.fixture(scope="module")
def alice(node):
    with tenant(node, "alice") as dev:
        yield dev


def node_paths(node) -> list[str]:
    """Files of the node a build must not reach: each exists (outside)."""
    paths = [node["secret"], node["tokens"], str(node["pki"].pool.key), "/etc/hostname", "/etc/passwd",
             f"/proc/{node['pool'].pid}/environ", "/proc/1/environ", "/proc/self/environ",
             "/proc/self/cmdline", "/proc/self/maps"]
    for path in paths:
        assert os.path.exists(path), path
    return paths


def twin(path: str) -> str:
    missing = path + ".twin"
    assert not os.path.exists(missing)
    return missing


# -- spellings: each turns a path into (source, options) ---------------------------------

#: before the directive's '#': nothing, blanks, comments (which become whitespace first)
LEADS = ["", "  ", "\t", "/**/", "/* x */ ", "/*\n*/"]
#: the '#' itself: the digraph %: and the trigraph ??= are it too
HASHES = ["#", "%:", "??="]
#: between '#' and the directive's name, and spliced inside it
GAPS = ["", " ", "/**/", "\\\n", " \\\n "]
DIRECTIVES = ["include", "inc\\\nlude", "include_next", "import", "embed"]
STRINGIZE = "#define STR_(x) #x\n#define STR(x) STR_(x)\n"


def _paste_split(path: str, seed: int) -> tuple[str, str] | None:
    """Where ``path`` can be cut inside a word, for ``a##b`` to rejoin it."""
    cuts = [i for i in range(1, len(path)) if re.match(r"\w\w", path[i - 1:i + 1])]
    if not cuts:
        return None
    i = cuts[seed % len(cuts)]
    return path[:i], path[i:]


def operand(form: str, path: str, seed: int) -> tuple[str, str]:
    """(definitions, the directive's operand) naming ``path``."""
    if form == "quoted":
        return "", f'"{path}"'
    if form == "angled":
        return "", f"<{path}>"
    if form == "spliced":           # a backslash-newline inside the path
        i = 1 + seed % (len(path) - 1)
        return "", f'"{path[:i]}\\\n{path[i:]}"'
    if form == "macro":             # #define X "/etc/hostname"  #include X
        return f'#define NODE_FILE "{path}"\n', "NODE_FILE"
    if form == "macro_angled":
        return f"#define NODE_FILE <{path}>\n", "NODE_FILE"
    if form == "stringized":        # the path as tokens, made a string by #
        return STRINGIZE, f"STR({path})"
    if form == "pasted":            # ... and two halves joined by ##
        halves = _paste_split(path, seed)
        if halves is None:
            return STRINGIZE, f"STR({path})"
        return STRINGIZE + "#define CAT(a, b) a##b\n", f"STR(CAT({halves[0]}, {halves[1]}))"
    if form == "relative":          # from the source's own directory up to /
        return "", '"' + "../" * 12 + path.lstrip("/") + '"'
    raise AssertionError(form)


FORMS = ["quoted", "angled", "spliced", "macro", "macro_angled", "stringized", "pasted", "relative"]


def directive_spelling(path: str, lead: str, hash_: str, gap: str, directive: str, form: str,
                       seed: int) -> tuple[str, str]:
    definitions, what = operand(form, path, seed)
    return f"{definitions}{lead}{hash_}{gap}{directive} {what}\n{ADD}", ""


def has_include_spelling(path: str, form: str, seed: int) -> tuple[str, str]:
    """Existence alone, asked of the preprocessor: an error if it is there."""
    definitions, what = operand(form, path, seed)
    return f"{definitions}#if __has_include({what})\n#error the file exists\n#endif\n{ADD}", ""


def option_spelling(path: str, option: str) -> tuple[str, str]:
    """Build options that name the path or its directory."""
    directory, base = os.path.split(path)
    if option in ("-I", "-isystem", "-iquote", "-idirafter", "--sysroot=", "-isysroot"):
        glue = "" if option.endswith("=") else " "
        quote = f'"{base}"' if option in ("-I", "-iquote") else f"<{base}>"
        return f"#include {quote}\n{ADD}", f"{option}{glue}{directory}"
    if option == "-I(attached)":
        return f'#include "{base}"\n{ADD}', f"-I{directory}"
    if option in ("-include", "-imacros"):
        return ADD, f"{option} {path}"
    if option == "@":
        return ADD, f"@{path}"
    raise AssertionError(option)


OPTIONS = ["-I", "-I(attached)", "-isystem", "-iquote", "-idirafter", "--sysroot=", "-isysroot", "-include",
           "-imacros", "@"]


@st.composite
def spellings(draw):
    """A function of the path: (source, options) that try to read it."""
    kind = draw(st.sampled_from(["directive", "directive", "directive", "has_include", "option"]))
    seed = draw(st.integers(0, 1 << 16))
    if kind == "directive":
        parts = (draw(st.sampled_from(LEADS)), draw(st.sampled_from(HASHES)), draw(st.sampled_from(GAPS)),
                 draw(st.sampled_from(DIRECTIVES)), draw(st.sampled_from(FORMS)))
        return lambda path: directive_spelling(path, *parts, seed)
    if kind == "has_include":
        form = draw(st.sampled_from([f for f in FORMS if f != "spliced"]))
        return lambda path: has_include_spelling(path, form, seed)
    option = draw(st.sampled_from(OPTIONS))
    return lambda path: option_spelling(path, option)


#: spellings known to be dangerous, each tried on every run (the generator
#: draws the rest): the issue's own first
KNOWN = [
    lambda p: directive_spelling(p, "/**/", "#", "", "include", "quoted", 0),
    lambda p: directive_spelling(p, "", "#", "", "include", "quoted", 0),
    lambda p: directive_spelling(p, "", "#", "\\\n", "include", "angled", 0),
    lambda p: directive_spelling(p, "", "??=", "", "include", "quoted", 0),
    lambda p: directive_spelling(p, "", "%:", "", "include", "macro", 0),
    lambda p: directive_spelling(p, "", "#", "", "include", "stringized", 0),
    lambda p: directive_spelling(p, "", "#", "", "include", "pasted", 3),
    lambda p: directive_spelling(p, "", "#", "", "include", "spliced", 5),
    lambda p: directive_spelling(p, "", "#", "", "include_next", "quoted", 0),
    lambda p: directive_spelling(p, "", "#", "", "import", "relative", 0),
    lambda p: directive_spelling(p, "", "#", "", "embed", "quoted", 0),
    lambda p: has_include_spelling(p, "quoted", 0),
    lambda p: option_spelling(p, "-I"),
    lambda p: option_spelling(p, "-include"),
    lambda p: option_spelling(p, "@"),
]


# -- outcomes --------------------------------------------------------------------------

def outcome(dev, source: str, options: str, path: str) -> tuple:
    """What the tenant gets back, the path's own text taken out (and PoCL's
    random temporary file names)."""
    try:
        program = dev.build(source, options=options)
    except AccelmigError as exc:
        got = (exc.code.value, exc.message, str(exc.details.get("log", "")))
    else:
        got = ("built", " ".join(program.kernels), program.build_log)
        dev.free_program(program)
    return tuple(_normalise(text, path) for text in got)


def _normalise(text: str, path: str) -> str:
    directory, base = os.path.split(path)
    for spelled in (path, path.lstrip("/"), base, directory):
        if spelled:
            text = text.replace(spelled, "<path>")
    return re.sub(r"tempfile_\w+", "tempfile_X", text)


def assert_no_difference(dev, spelling, path: str) -> None:
    source, options = spelling(path)
    existing = outcome(dev, source, options, path)
    missing = twin(path)
    source_twin, options_twin = spelling(missing)
    absent = outcome(dev, source_twin, options_twin, missing)
    for text in existing + absent:
        assert MARKER not in text, f"the node's secret reached the tenant: {text!r}"
    assert existing == absent, (f"{path} exists and the build tells (options {options!r}):\n"
                                f"{source}\n-> {existing}\nits missing twin: {absent}")


@pytest.mark.parametrize("known", range(len(KNOWN)))
def test_known_spellings_cannot_tell_a_node_file_from_a_missing_one(node, alice, known):
    for path in (node["secret"], "/etc/hostname", f"/proc/{node['pool'].pid}/environ"):
        assert_no_difference(alice, KNOWN[known], path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spelling=spellings(), which=st.integers(0, 9))
def test_no_include_spelling_reads_a_node_file(node, alice, spelling, which):
    path = node_paths(node)[which]
    assert_no_difference(alice, spelling, path)


def test_a_normal_program_still_builds_and_computes_and_its_log_is_clean(alice):
    buf = alice.upload(np.arange(64, dtype=np.uint32).tobytes())
    program = alice.build("#define STEP 3u\n" + ADD.replace("+= n", "+= n + STEP"), options="-DUNUSED=1 -w")
    alice.launch(program, "add", (64,), None, buf, np.uint32(4))
    assert (np.frombuffer(alice.read(buf), np.uint32) == np.arange(64) + 7).all()
    assert MARKER not in program.build_log


def device_directories(pool_pid: int, name: str) -> list[str]:
    """The node's directories of a tenant's device processes: the working
    directory of each the pool started for it."""
    import psutil
    found = []
    for child in psutil.Process(pool_pid).children():
        argv = child.cmdline()
        if "accelmig.pool.devices.worker" in argv and argv[argv.index("--tenant") + 1] == name:
            found.append(child.cwd())
    return found


def test_two_tenants_see_nothing_of_each_other(node, alice):
    """Alice builds a program of her own; bob cannot reach what her build
    left, by the node's path of her directory nor by the path her sandbox
    shows it at (/tenant/cache/...)."""
    alice.build(ADD.replace("add(", f"alice_{MARKER[-8:]}("))
    directories = device_directories(node["pool"].pid, "alice")
    assert len(directories) == 1, directories
    cached = [os.path.join(root, name) for root, _, files in os.walk(directories[0]) for name in files
              if name in ("program.bc", "program.cl")]
    assert cached, "alice's build left nothing in her kernel cache"
    with tenant(node, "bob") as bob:
        for path in cached[:2]:
            assert_no_difference(bob, KNOWN[0], path)
            assert_no_difference(bob, KNOWN[0], os.path.join("/tenant", os.path.relpath(path, directories[0])))
        assert device_directories(node["pool"].pid, "bob") != directories


def test_the_device_process_says_it_is_confined(node, alice):
    alice.info()
    entry = node["pool"].wait_log(lambda e: "device process of tenant alice ready" in e["msg"])
    assert "mount namespace with a root of its own" in entry["msg"]
    assert "landlock" in entry["msg"]


# -- where no sandbox can be had ---------------------------------------------------------

#: a node whose kernel gives the pool's user no namespaces: user namespaces
#: off (the limit at 0, as a distribution's sysctl may set it), no privilege
NO_NAMESPACES = ("unshare", "--user", "--map-root-user", "sh", "-c",
                 "echo 0 > /proc/sys/user/max_user_namespaces && "
                 'exec setpriv --bounding-set=-all --inh-caps=-all -- "$@"', "sh")


@pytest.fixture
def no_namespaces():
    import subprocess
    if subprocess.run([*NO_NAMESPACES, "true"], capture_output=True).returncode != 0:
        pytest.skip("SKIPPED LOUDLY: this machine gives no user namespace to make a node without them")
    return NO_NAMESPACES


def test_a_node_that_cannot_confine_says_so_and_refuses_every_build(tmp_path, node, no_namespaces):
    pool = PoolProcess(tmp_path, tenants_file(), tls=node["pki"], wrapper=no_namespaces)
    try:
        said = pool.wait_log(lambda e: "cannot be confined" in e["msg"])
        assert said["level"] == "error" and "REFUSED" in said["msg"], said
        with connect(pool.endpoint, TOKENS["alice"], cafile=str(node["pki"].ca), agent=False) as dev:
            for path in (node["secret"], twin(node["secret"])):
                source, options = KNOWN[0](path)
                with pytest.raises(AccelmigError) as refused:
                    dev.build(source, options=options)
                assert refused.value.code.value == "FORBIDDEN", refused.value
                assert "cannot be confined" in refused.value.message
                assert MARKER not in str(refused.value.to_wire())
            with pytest.raises(AccelmigError, match="may not build programs"):
                dev.build(ADD)
            buf = dev.upload(b"kept" * 16)          # the rest of the session is served
            assert dev.read(buf) == b"kept" * 16
    finally:
        pool.stop()


def test_the_opt_out_serves_builds_unconfined_and_warns(tmp_path, node, no_namespaces):
    pool = PoolProcess(tmp_path, tenants_file(), tls=node["pki"], wrapper=no_namespaces,
                       extra=("--allow-unconfined-builds",))
    try:
        said = pool.wait_log(lambda e: "cannot be confined" in e["msg"])
        assert said["level"] == "warning" and "allow_unconfined_builds" in said["msg"], said
        with connect(pool.endpoint, TOKENS["alice"], cafile=str(node["pki"].ca), agent=False) as dev:
            buf = dev.upload(np.arange(64, dtype=np.uint32).tobytes())
            dev.launch(dev.build(ADD), "add", (64,), None, buf, np.uint32(9))
            assert (np.frombuffer(dev.read(buf), np.uint32) == np.arange(64) + 9).all()
    finally:
        pool.stop()


@pytest.mark.parametrize("allowed", [False, True])
def test_device_isolation_none_refuses_builds_unless_allowed(allowed):
    """No device process: a build would run in the pool's own process."""
    from accelmig.lab.poolthread import PoolThread
    with PoolThread(tenants={"alice": (TOKENS["alice"], "64MiB")}, device_isolation="none",
                    allow_unconfined_builds=allowed) as pool:
        with connect(pool.endpoint, TOKENS["alice"], agent=False) as dev:
            if allowed:
                assert dev.build(ADD).kernels == ["add"]
            else:
                with pytest.raises(AccelmigError, match="device_isolation = none") as refused:
                    dev.build(ADD)
                assert refused.value.code.value == "FORBIDDEN"


# -- the deployment's pool user: no root ----------------------------------------------

NOBODY = 65534


@pytest.mark.root
def test_a_pool_of_an_unprivileged_user_confines_its_tenants_too(node):
    """As the system user a deployment runs the pool as (here: nobody):
    the sandbox needs no privilege.  The node's secret is readable by that
    user (mode 0644), so only the sandbox keeps it from a build."""
    import shutil
    import subprocess
    import tempfile
    as_nobody = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    probe = subprocess.run([*as_nobody, sys.executable, "-c", "import accelmig.pool.devices.worker"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: user {NOBODY} cannot run this checkout: {probe.stderr[-300:]}")
    from accelmig.lab.certs import make_pki
    from pathlib import Path
    base = Path(tempfile.mkdtemp(prefix="nobody-pool-"))
    try:
        pki = make_pki(base / "pki", hosts=())
        secret = base / "readable-secret.h"
        secret.write_text(f"{MARKER} leaked = 1;\n")
        pool_files = base / "pool"
        pool_files.mkdir()
        (base / "home").mkdir()                     # its HOME: PoCL's and pyopencl's caches
        for path in [base, *base.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
        os.chmod(base, 0o755)
        secret.chmod(0o644)
        pool = PoolProcess(pool_files, tenants_file(), tls=pki, wrapper=as_nobody, env={"HOME": str(base / "home")})
        try:
            with connect(pool.endpoint, TOKENS["alice"], cafile=str(pki.ca), agent=False, timeout=60) as dev:
                ready = pool.wait_log(lambda e: "device process of tenant alice ready" in e["msg"])
                assert "user namespace" in ready["msg"] and "landlock" in ready["msg"], ready
                for path in (str(secret), "/etc/passwd", f"/proc/{pool.pid}/environ"):
                    assert_no_difference(dev, KNOWN[0], path)
                assert dev.build(ADD).kernels == ["add"]
        finally:
            pool.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)

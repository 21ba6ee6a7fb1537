"""``accelmig-agent``: the guest agent (standard library only)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from accelmig.runtime import logs
from accelmig.runtime.cli import exit_codes_epilog, version
from accelmig.wire import channel as ch
from accelmig.wire.attestation import parse_prove
from accelmig.wire.dataplane import parse_endpoint
from accelmig.wire.errors import AccelmigError, AlreadyRunning, BadRequest

DEFAULT_PORT = "/dev/virtio-ports/" + ch.CHANNEL_NAME

DESCRIPTION = """\
The accelmig guest agent.  It runs inside the VM: it is the guest end of the
host's virtio-serial channel (org.accelmig.agent.0) and the hub of the
accelerator drivers of the guest's applications.  After a live migration the
destination host tells it the new host's identity (where the pool is from
there, and for host-bound fabrics the guest NIC's new address); it applies
the guest network change and tells every driver to resume its session.
"""


EXIT_CODES = {1: "rehome/prove/status: the agent answered that it failed",
              2: "usage, a bad option value or rehome or prove document, or the channel cannot be opened",
              3: "run: another agent already serves the socket; rehome/prove/status: no agent answers"}


def _endpoint(text: str) -> str:
    """argparse type: wire's one endpoint parser (HOST:PORT, [v6]:PORT, port 1-65535)."""
    try:
        parse_endpoint(text)
    except BadRequest as exc:
        raise argparse.ArgumentTypeError(exc.kwargs.get("reason", exc.message)) from None
    return text


def _log_level(text: str) -> str:
    """argparse type: a logging level name, any case."""
    try:
        logs.level_number(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.upper()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelmig-agent", description=DESCRIPTION,
                                     epilog=exit_codes_epilog(EXIT_CODES),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the agent daemon",
                         description="Serve the host channel and the guest's drivers until SIGTERM "
                                     "(SIGHUP: logged; every setting is an option, so a restart changes them).")
    run.add_argument("--port", default=DEFAULT_PORT,
                     help=f"the channel: a virtio-serial device, a unix socket path to listen on "
                          f"(tests, trials without a VM), or 'none' (a VM with only qemu-guest-agent: "
                          f"hosts rehome it through 'accelmig-agent rehome --stdin') [default {DEFAULT_PORT}]")
    run.add_argument("--socket", default=ch.DEFAULT_AGENT_SOCKET,
                     help=f"where drivers register [default {ch.DEFAULT_AGENT_SOCKET}]")
    run.add_argument("--state-dir", default="/run/accelmig", help="where the last identity is kept")
    run.add_argument("--endpoint", metavar="HOST:PORT", type=_endpoint,
                     help="a static pool endpoint (without a host that tells one)")
    run.add_argument("--rehome-timeout", type=float, default=30.0,
                     help="seconds a rehome waits for the drivers [default 30]")
    run.add_argument("--log-format", choices=["json", "text"], default="text")
    run.add_argument("--log-level", type=_log_level, default="INFO", metavar="LEVEL",
                     help=f"{', '.join(logs.LEVELS)} [default INFO]")

    rehome = sub.add_parser("rehome", help="rehome from a JSON document (qemu-guest-agent guest-exec)",
                            description="Do what a 'rehome' on the channel does, from a JSON document "
                                        "{migration_id, identity, tickets}; for VMs that only have "
                                        "qemu-guest-agent (OpenStack Nova).  Prints the outcome as JSON.")
    rehome.add_argument("--stdin", action="store_true", required=True, help="read the document from stdin")
    rehome.add_argument("--piece", action="store_true",
                        help="the document is one piece of a big rehome's tickets {migration_id, tickets}: "
                             "stage it for the rehome of that migration id that follows (the host sends "
                             "a rehome too big for one guest-exec this way)")
    rehome.add_argument("--socket", default=ch.DEFAULT_AGENT_SOCKET, help="the running agent's socket")

    prove = sub.add_parser("prove", help="the drivers' binding proofs for a host (qemu-guest-agent guest-exec)",
                           description="Ask every driver of this guest that holds one of the named sessions "
                                       "(all of them, a page at a time, when the document names none) for its "
                                       "proof that binds the session to this guest's domain on the asking "
                                       "host, from a JSON document {host, challenges, sids?, after?} "
                                       "(accelmig.wire.attestation); for VMs that only have qemu-guest-agent.  "
                                       "Prints {proofs, refused, next} as JSON.  Root only.")
    prove.add_argument("--stdin", action="store_true", required=True, help="read the document from stdin")
    prove.add_argument("--socket", default=ch.DEFAULT_AGENT_SOCKET, help="the running agent's socket")

    status = sub.add_parser("status", help="what the running agent knows")
    status.add_argument("--socket", default=ch.DEFAULT_AGENT_SOCKET)

    install = sub.add_parser(
        "install", help="install the agent as a systemd service",
        description="Write accelmig-agent.service (ExecStart: this installation's agent; hardened: "
                    "docs/systemd.md) into UNIT_DIR and run 'systemctl daemon-reload' when systemd is "
                    "PID 1 and the unit went where it reads.  With the default --port the unit is "
                    "bound to the channel's device (started when it appears, stopped with it); with "
                    "--port none (a VM with only qemu-guest-agent) it is wanted by multi-user.target.  "
                    "A rerun that would write the same file says 'unchanged'.  Then: "
                    "systemctl enable --now accelmig-agent.")
    install.add_argument("--systemd", action="store_true",
                         help="install the systemd unit (the only target today; the init script "
                              "for guests without systemd is agent/data/accelmig-agent.init)")
    install.add_argument("--port", default=DEFAULT_PORT,
                         help=f"the channel device the service runs on, or 'none' [default {DEFAULT_PORT}]")
    install.add_argument("--endpoint", metavar="HOST:PORT", type=_endpoint,
                         help="a static pool endpoint for the service (see 'run --endpoint')")
    install.add_argument("--root", metavar="DIR", help="install under this alternate file system root")
    install.add_argument("--unit-dir", default="/etc/systemd/system",
                         help="where the unit goes (under --root) [default /etc/systemd/system]")
    install.add_argument("--print", dest="print_only", action="store_true",
                         help="print the unit and install nothing")
    install.add_argument("--json", dest="as_json", action="store_true", help="machine-readable output")
    return parser


def _install(parser: argparse.ArgumentParser, args) -> int:
    from accelmig.agent import unit
    from accelmig.runtime import units
    if not args.systemd:
        parser.error("install: nothing to install: pass --systemd")      # exit 2
    try:
        text = unit.render(args.port, args.endpoint)
    except AccelmigError as exc:
        print(f"accelmig-agent: {exc.message}", file=sys.stderr)
        return 2
    if args.print_only:
        sys.stdout.write(text)
        return 0
    try:
        result = units.install_units({unit.UNIT_NAME: text}, root=args.root, unit_dir=args.unit_dir)
    except OSError as exc:
        print(f"accelmig-agent: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    result["mode"] = unit.mode_of(args.port)
    if args.as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"mode: {result['mode']}")
        print("\n".join(units.summary(result)))
    if result["reload"]["action"] == "failed":
        print(f"accelmig-agent: {result['reload']['reason']}", file=sys.stderr)
        return 1
    return 0


#: the most a rehome document on stdin may hold (a thousand sessions' tickets
#: are ~350 KiB; the agent keeps at most 4096 sessions)
MAX_DOCUMENT = 16 << 20


def _ask_agent(socket_path: str, kind: str, timeout: float = 60.0, **fields) -> dict:
    """The running agent's answer as ``{"ok", "result"|"error"}``.  A
    ``rehome_local`` whose document is too big for one line sends its
    tickets in pieces first (``wire.channel.rehome_pieces``); a ``status``
    follows its pages (``next``) and answers them all in one."""
    from accelmig.agent.driver.registry import agent_connection
    try:
        conn = agent_connection(socket_path, timeout=timeout)
    except AccelmigError as exc:
        print(f"accelmig-agent: no agent answers at {socket_path}: {exc.kwargs.get('reason', exc)}",
              file=sys.stderr)
        sys.exit(3)
    try:
        if kind == "rehome_local":
            pieces, document = ch.rehome_pieces(fields.pop("document"))
            for piece in pieces:
                conn.call("tickets", **piece)
            fields["document"] = document
        result = conn.call(kind, **fields)
        if kind == "status":
            pages = 0
            while isinstance(result, dict) and result.get("next") and pages < 1 << 16:
                following = conn.call(kind, after=result["next"], **fields)
                result = dict(result, sessions=result["sessions"] + following.get("sessions", []),
                              next=following.get("next"))
                pages += 1
        return {"ok": True, "result": result}
    except AccelmigError as exc:
        return {"ok": False, "error": exc.to_wire()}
    finally:
        conn.close()


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "install":
        return _install(parser, args)
    if args.command == "run":
        from accelmig.agent.daemon import Agent
        from accelmig.wire.identity import HostIdentity
        logs.setup("accelmig-agent", args.log_format, args.log_level)
        identity = None
        if args.endpoint:
            try:
                identity = HostIdentity(host_id="static", pool_endpoint=args.endpoint)
            except AccelmigError as exc:
                print(f"accelmig-agent: --endpoint: {exc}", file=sys.stderr)
                return 2
        agent = Agent(args.port, args.socket, state_dir=args.state_dir, identity=identity,
                      rehome_timeout=args.rehome_timeout)
        # before open() logs that the agent is there: a signal from then on is handled
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: agent.stop())
        signal.signal(signal.SIGHUP, lambda *_: agent.reload())     # SIGHUP's default kills
        try:
            agent.open()
        except AlreadyRunning as exc:
            print(f"accelmig-agent: {exc.message}", file=sys.stderr)
            return 3
        except AccelmigError as exc:
            print(f"accelmig-agent: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"accelmig-agent: cannot open {exc.filename or args.port}: {exc.strerror}", file=sys.stderr)
            return 2
        agent.run()
        return 0
    if args.command == "rehome":
        raw = sys.stdin.read(MAX_DOCUMENT + 1)
        if len(raw) > MAX_DOCUMENT:
            print(f"accelmig-agent: the rehome document is over {MAX_DOCUMENT} bytes", file=sys.stderr)
            return 2
        try:
            document = json.loads(raw)
            if not isinstance(document, dict):
                raise BadRequest(reason="the document must be a JSON object")
            # refuse a broken document before bothering the agent
            ch.parse_tickets(document) if args.piece else ch.parse_rehome(document)
        except ValueError as exc:
            print(f"accelmig-agent: the rehome document is not JSON: {exc}", file=sys.stderr)
            return 2
        except AccelmigError as exc:
            print(f"accelmig-agent: bad rehome document: {exc}", file=sys.stderr)
            return 2
        if args.piece:
            answer = _ask_agent(args.socket, "tickets", migration_id=document["migration_id"],
                                tickets=document.get("tickets") or {})
            print(json.dumps(answer.get("result") if answer.get("ok") else answer, indent=2))
            return 0 if answer.get("ok") else 1
        answer = _ask_agent(args.socket, "rehome_local", document=document)
        print(json.dumps(answer.get("result") if answer.get("ok") else answer, indent=2))
        if not answer.get("ok"):
            return 1
        return 0 if answer["result"].get("ok") else 1
    if args.command == "prove":
        raw = sys.stdin.read(MAX_DOCUMENT + 1)
        try:
            request = json.loads(raw) if len(raw) <= MAX_DOCUMENT else None
            parse_prove(request)
        except ValueError as exc:
            print(f"accelmig-agent: the prove document is not JSON: {exc}", file=sys.stderr)
            return 2
        except AccelmigError as exc:
            print(f"accelmig-agent: bad prove document: {exc}", file=sys.stderr)
            return 2
        answer = _ask_agent(args.socket, "prove_local", request=request)
        print(json.dumps(answer.get("result") if answer.get("ok") else answer))
        return 0 if answer.get("ok") else 1
    if args.command == "status":
        answer = _ask_agent(args.socket, "status")
        print(json.dumps(answer.get("result"), indent=2))
        return 0 if answer.get("ok") else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

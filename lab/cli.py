"""``accelmig lab`` (also ``accelmig-lab``): a local lab on this machine (root).

It ships in the ``accelmig-lab`` distribution, a test rig: ``accelmig``
offers the ``lab`` command only where that is installed (the entry point
``lab`` of the group ``accelmig.commands``).

Network namespaces for a pool node and two hypervisor hosts; a real libvirt
daemon per host (its own mount and UTS namespace, hostname, host UUID);
accelmig-pool on a PoCL device in the pool namespace; hostd and the hook on
each host; a RAM-only guest built from Debian packages that runs the
accelmig agent and a demo solver computing on the pool.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import click

DEFAULT_NAME = "accelmig"
VM = "demo-vm"


def _need_root():
    if os.geteuid() != 0:
        click.echo("accelmig lab: needs root (network namespaces, mounts, libvirt daemons)", err=True)
        sys.exit(2)


def _lab(name: str, insecure: bool | None = None, pool_nodes: int | None = None, cluster_ttl: float | None = None):
    from accelmig.lab.accel import AccelLab
    extra = {"cluster_ttl": cluster_ttl} if cluster_ttl is not None else {}
    return AccelLab(name, insecure=insecure, pool_nodes=pool_nodes, **extra)


insecure_option = click.option(
    "--insecure", is_flag=True, default=None,
    help="Plain TCP between guests, hosts and the pool instead of TLS (debugging; also "
         "ACCELMIG_LAB_INSECURE=1). Default: TLS, with a throwaway CA made in the lab's directory.")


def _mode(accel) -> str:
    return (f"TLS (CA {accel.lab.pool_ca})" if accel.lab.tls
            else "INSECURE: plain TCP between guests, hosts and the pool")


name_option = click.option("--name", default=DEFAULT_NAME, show_default=True,
                           help="The lab's name (several labs can coexist).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def lab():
    """A local lab: two libvirt hosts, a pool, a VM.

    The VM computes on the pool while it live-migrates between the hosts.

    \b
      accelmig lab demo       the whole story, with a table per migration
      accelmig lab up         bring it up and leave it running
      accelmig lab env        KEY=value lines to drive it with plain virsh
      accelmig lab boot       start the demo VM on hostA
      accelmig lab migrate    move the VM to the other host
      accelmig lab down       remove everything (also after a crash)
      accelmig lab image      build (or find in the cache) the guest image
      accelmig lab boot-test  the rig's plumbing alone, timed (no accelmig in it)
    """


@lab.command()
@name_option
@click.option("--lenient", is_flag=True, help="The hooks let migrations through when hostd is down.")
@insecure_option
@click.option("--pool-nodes", type=click.IntRange(1, 2), default=None,
              help="2: a pool of two nodes on etcd: a second node (netns pool2, 10.88.0.2, PoCL's 'basic' "
                   "device; the first serves 'pthread') and etcd in a namespace of its own (netns etcd, "
                   "10.88.8.1 on the nodes' cluster network). Both nodes share the tokens, hosts and the "
                   "pool certificate; guests reach both. [default: 1, or what the running lab has]")
@click.option("--cluster-ttl", type=click.FloatRange(min=1.0), default=None, metavar="SECONDS",
              help="With --pool-nodes 2: the nodes' etcd lease; a killed node leaves the pool this long "
                   "after its last renewal. [default 3]")
def up(name, lenient, insecure, pool_nodes, cluster_ttl):
    """Bring the lab up (idempotent) and print how to reach it."""
    _need_root()
    if cluster_ttl is not None and pool_nodes != 2:
        click.echo("accelmig lab: --cluster-ttl is for a pool of two nodes (--pool-nodes 2)", err=True)
        sys.exit(2)
    accel = _lab(name, insecure, pool_nodes, cluster_ttl)
    started = time.monotonic()
    click.echo(f"bringing lab {name} up ...", err=True)
    try:
        accel.up(strict=not lenient)
    except RuntimeError as exc:
        click.echo(f"accelmig lab: {exc}", err=True)
        sys.exit(1)
    click.echo(f"lab {name} up in {time.monotonic() - started:.1f} s; {_mode(accel)}", err=True)
    for line in accel.env_lines():
        click.echo(line)


@lab.command()
@name_option
def down(name):
    """Remove every process, namespace, mount and link of the lab."""
    _need_root()
    _lab(name).down()
    click.echo(f"lab {name} is down")


@lab.command()
@name_option
@click.option("--domain", default=VM, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Everything the lab knows of itself, as JSON.")
def env(name, domain, as_json):
    """Shell lines to drive the lab by hand, e.g.

    \b
      eval "$(accelmig lab env)"
      virsh -c "$HOSTA_URI" list
      virsh -c "$HOSTA_URI" migrate --live --p2p $DOMAIN $HOSTB_P2P_URI --migrateuri $HOSTB_MIGRATE_URI
      virsh -c "$HOSTA_URI" migrate --live --p2p $DOMAIN $HOSTB_SSH_URI --migrateuri $HOSTB_MIGRATE_URI
    """
    _need_root()
    accel = _lab(name)
    if accel.lab.state.get("status") != "up":
        click.echo(f"accelmig lab: lab {name} is not up (accelmig lab up --name {name})", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(accel.lab.env(), indent=1))
        return
    for line in accel.env_lines(domain):
        click.echo(line)


@lab.command()
@name_option
@click.option("--host", type=click.Choice(["hostA", "hostB"]), default="hostA", show_default=True)
@click.option("--domain", default=VM, show_default=True)
@click.option("--steps", type=int, default=600, show_default=True, help="Solver steps the demo runs.")
def boot(name, host, domain, steps):
    """Start the demo VM (the solver starts with it)."""
    _need_root()
    accel = _lab(name).up()
    accel.boot(domain, accel.demo_image(steps=steps, pause=0.5), host)
    line = accel.wait_demo(domain, lambda ls: [l for l in ls if "step" in l], timeout=120,
                           what="the solver's first progress")[-1]
    click.echo(f"{domain} runs on {host}: step {line['step']}, residual {line['residual']:.3g}")


@lab.command()
@name_option
@click.option("--domain", default=VM, show_default=True)
@click.option("--to", "dest", type=click.Choice(["hostA", "hostB"]), help="Default: the other host.")
@click.option("--via", type=click.Choice(["virsh", "accelmig"]), default="virsh", show_default=True)
@click.option("--transport", type=click.Choice(["tcp", "ssh"]), default="tcp", show_default=True,
              help="How the source's libvirtd reaches the destination's: qemu+tcp, or qemu+ssh "
                   "through the destination host's sshd.")
@click.option("--json", "as_json", is_flag=True)
def migrate(name, domain, dest, via, transport, as_json):
    """Live-migrate the VM and measure what it cost."""
    _need_root()
    accel = _lab(name)
    src = accel.where(domain)
    if src is None:
        click.echo(f"accelmig lab: {domain} runs nowhere (accelmig lab boot)", err=True)
        sys.exit(1)
    dest = dest or ("hostB" if src == "hostA" else "hostA")
    result = (accel.migrate_virsh if via == "virsh" else accel.migrate_accelmig)(domain, src, dest,
                                                                                  transport=transport)
    result.pop("record", None)
    click.echo(json.dumps(result, indent=2) if as_json else _row(f"{src}->{dest}", result))
    sys.exit(0 if result.get("ok") else 1)


HEADER = (f"{'migration':12} {'via':17} {'wall':>7} {'VM downtime':>12} {'accel blackout':>15} "
          f"{'re-sent':>8} {'rebuilds':>8} {'sessions':>9}")


def _row(label: str, r: dict) -> str:
    if not r.get("ok") and "error" in r:
        return f"{label:12} {r.get('via', ''):17} FAILED: {r['error']}"
    blackout = max(r.get("blackout_ms", {}).values(), default=None)
    return (f"{label:12} {r['via']:17} {r['wall_s']:>6.2f}s {str(r.get('downtime_ms')) + ' ms':>12} "
            f"{(f'{blackout:.0f} ms' if blackout is not None else '-'):>15} {r['bytes_resent']:>7}B "
            f"{r['rebuilds']:>8} {r['resumed']:>4}/{r['sessions']:<4}")


@lab.command()
@name_option
@click.option("--keep", is_flag=True, help="Leave the lab up afterwards.")
@click.option("--steps", type=int, default=600, show_default=True)
@insecure_option
def demo(name, keep, steps, insecure):
    """The main job: a VM computes on the pool while it live-migrates.

    Boots the VM on hostA with the demo solver running on the pool,
    migrates it A->B and B->A with plain 'virsh migrate --live', once more
    with 'accelmig migrate', and back with 'virsh migrate' to a qemu+ssh URI
    (where openssh-server is installed), checks the final result against a run that
    never migrated, and prints a table per migration: VM downtime (libvirt),
    accelerator blackout, bytes of compute logic and fixed data re-sent to
    the pool (must be 0), program rebuilds, sessions resumed, total time.
    """
    _need_root()
    bold = (lambda s: f"\033[1m{s}\033[0m") if sys.stdout.isatty() else (lambda s: s)
    accel = _lab(name, insecure)
    t0 = time.monotonic()
    ok = False
    try:
        click.echo(bold("1. the lab: pool + hostA + hostB (libvirt daemons, hostd, hook)"))
        accel.up()
        env = accel.lab.env()
        click.echo(f"   pool {env['pool']['data']} in netns {env['pool']['netns']}; "
                   f"hosts {', '.join(env['hosts'])} ({accel.lab.virt_type.upper()})")
        click.echo(f"   {_mode(accel)}")
        click.echo(bold("2. the guest image (cached) and a reference run that never migrates"))
        image = accel.demo_image(steps=steps, pause=0.5)
        reference = accel.reference(steps=steps)
        click.echo(f"   image {image.key[:12]}; reference result sha256 {reference['sha256'][:16]}")
        click.echo(bold(f"3. {VM} boots on hostA; its solver computes on the pool"))
        accel.boot(VM, image, "hostA")
        stop = threading.Event()
        shown = set()

        def follow():
            while not stop.is_set():
                for line in accel.demo_lines(VM):
                    step = line.get("step")
                    if step is not None and step not in shown and step % 100 == 0:
                        shown.add(step)
                        click.echo(f"   solver step {step:4d}, residual {line['residual']:.3e}")
                stop.wait(0.5)

        accel.wait_demo(VM, lambda ls: [l for l in ls if "step" in l], timeout=120, what="the solver's start")
        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        click.echo(bold("4. live migrations while it computes"))
        plan = [("hostA", "hostB", "virsh", "tcp"), ("hostB", "hostA", "virsh", "tcp"),
                ("hostA", "hostB", "accelmig", "tcp")]
        if accel.lab.ssh:         # as operators type it: virsh migrate --live --p2p vm qemu+ssh://hostA/system
            plan.append(("hostB", "hostA", "virsh", "ssh"))
        results = []
        for src, dst, via, transport in plan:
            time.sleep(1.0)
            fn = accel.migrate_virsh if via == "virsh" else accel.migrate_accelmig
            result = fn(VM, src, dst, transport=transport)
            result.pop("record", None)
            results.append((f"{src}->{dst}", result))
            click.echo(f"   {src} -> {dst} ({result['via']}): "
                       f"{'ok' if result['ok'] else 'FAILED ' + str(result.get('error'))}")
        done = accel.demo_done(VM, timeout=300)
        stop.set()
        click.echo()
        click.echo(HEADER)
        for label, result in results:
            click.echo(_row(label, result))
        identical = done.get("sha256") == reference["sha256"]
        resent = sum(r.get("bytes_resent", 0) for _, r in results)
        rebuilds = sum(r.get("rebuilds", 0) for _, r in results)
        click.echo()
        click.echo(f"final result sha256 {done.get('sha256', '?')[:16]} after {done.get('steps')} steps "
                   f"and {done.get('resumes')} resumes; reference {reference['sha256'][:16]}")
        verdict = identical and resent == 0 and rebuilds == 0 and all(r["ok"] for _, r in results)
        click.echo(bold(("bit-identical, nothing re-sent, nothing rebuilt" if verdict else
                         "SOMETHING WENT WRONG (see above)") + f" — {time.monotonic() - t0:.0f} s in all"))
        ok = verdict
    finally:
        if keep:
            click.echo(f"lab {name} left up: accelmig lab env --name {name}; accelmig lab down --name {name}")
        else:
            accel.down()
    sys.exit(0 if ok else 1)


@lab.command()
@click.option("--with-qemu-ga", is_flag=True, help="Add qemu-guest-agent (a VM rehomed through guest-exec).")
@click.option("--force", is_flag=True, help="Build again even if the cache has it.")
def image(with_qemu_ga, force):
    """Build the guest image (or take it from the cache); say where."""
    _need_root()
    from accelmig.lab.image import ImageSpec, build_image
    built = build_image(ImageSpec(with_qemu_ga=with_qemu_ga), force=force)
    click.echo(json.dumps({"kernel": str(built.kernel), "initrd": str(built.initrd), "key": built.key,
                           "build_seconds": built.build_seconds, "cmdline": built.cmdline()}, indent=1))


@lab.command("boot-test")
@click.option("--name", default="boot-test", show_default=True,
              help="The lab's name (not the demo lab's: this one goes down afterwards).")
@click.option("--keep", is_flag=True, help="Leave the lab up afterwards.")
def boot_test(name, keep):
    """Time the rig's plumbing alone (boot, channel, migration).

    A guest boots on hostA, answers on its channel, reaches the pool's
    namespace un-NATed, live-migrates to hostB, answers there and reaches
    the pool from B's subnet.  No pool, hostd or hook: a smoke test for a
    machine being set up."""
    _need_root()
    from accelmig.lab import boottest
    from accelmig.lab.rig import Lab
    rig = Lab(name)
    try:
        rig.up()
        result = boottest.run(rig)
        result["lab_timings"] = rig.timings
    finally:
        if not keep:
            rig.down()
    click.echo(json.dumps(result, indent=1, default=str))
    ok = (result.get("pool_saw_from_A") == result.get("guest_address_A")
          and result.get("pool_saw_from_B") == result.get("guest_address_B"))
    sys.exit(0 if ok else 1)

"""The guest's init scripts are real files, package data of
``accelmig.lab.image`` at the paths they take in the guest, and the image
key follows their text: change one and the image is built anew."""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
from pathlib import Path

import pytest

from accelmig.lab.image import ImageSpec
from accelmig.lab.image.build import GUEST_TREE, guest_files, image_key
from accelmig.lab.image.guest_python import package_dir, stdlib_dir
from accelmig.lab.image.kernel import DEFAULT_MODULES, Kernel
from accelmig.plugin.domain import AGENT_CHANNEL_NAME, QEMU_GA_CHANNEL_NAME

SCRIPTS = ("init", "etc/inittab", "etc/accelmig/lib.sh", "etc/accelmig/rc",
           "etc/accelmig/init.d/45-qemu-ga", "etc/accelmig/init.d/50-agent", "etc/accelmig/init.d/60-app")
MODULES = list(DEFAULT_MODULES)


def test_the_scripts_are_files_of_the_package():
    package = Path(importlib.resources.files("accelmig.lab.image"))
    for rel in SCRIPTS:
        resource = GUEST_TREE.joinpath(rel)
        assert resource.is_file(), rel
        with importlib.resources.as_file(resource) as path:
            assert path.is_relative_to(package / "guest"), path
    generated = {f.path: f for f in guest_files(ImageSpec(hostname="guest-7", with_qemu_ga=True), MODULES)}
    # what the guest gets is the file's text with its @WORDS@ filled in
    init = GUEST_TREE.joinpath("init").read_text()
    assert "@HOSTNAME@" in init
    assert generated["/init"].data == init.replace("@HOSTNAME@", "guest-7").encode()
    assert f"port_name=${{ACCELMIG_AGENT_PORT:-{AGENT_CHANNEL_NAME}}}".encode() in \
        generated["/etc/accelmig/init.d/50-agent"].data
    assert f"/dev/virtio-ports/{QEMU_GA_CHANNEL_NAME}".encode() in generated["/etc/accelmig/init.d/45-qemu-ga"].data
    assert not [f.path for f in generated.values() if re.search(rb"@[A-Z_]+@", f.data)]   # every word filled in
    assert {path: oct(f.mode) for path, f in generated.items() if path in ("/init", "/etc/accelmig/rc",
                                                                          "/etc/accelmig/lib.sh", "/etc/inittab")} \
        == {"/init": "0o755", "/etc/accelmig/rc": "0o755", "/etc/accelmig/lib.sh": "0o644", "/etc/inittab": "0o644"}
    assert generated["/etc/accelmig/modules"].data.decode().split() == MODULES
    # qemu-ga starts only in images built with it
    without = {f.path for f in guest_files(ImageSpec(), MODULES)}
    assert "/etc/accelmig/init.d/45-qemu-ga" not in without and "/etc/accelmig/init.d/50-agent" in without


@pytest.fixture
def key_of(tmp_path):
    """The image key of the default spec with the guest files of ``tree``
    (the real inputs otherwise: this host's interpreter, stdlib, busybox,
    accelmig's agent and wire sources; a kernel named, not unpacked)."""
    spec = ImageSpec()
    for tool in (spec.python, spec.busybox):
        if not os.access(tool, os.X_OK):
            pytest.skip(f"SKIPPED LOUDLY: {tool} is not installed (./dev.sh setup installs it)")
    kernel = Kernel(package="linux-image-6.1.0-test-amd64", version="6.1.0-1", release="6.1.0-test-amd64",
                    dir=tmp_path / "kernel")
    stdlib, agent, wire = stdlib_dir(spec.python), package_dir("accelmig.agent"), package_dir("accelmig.wire")

    def key(tree) -> str:
        return image_key(spec, kernel, guest_files(spec, MODULES, tree), stdlib, agent, wire)
    return key


def test_changing_a_guest_file_changes_the_image_key(key_of, tmp_path):
    copy = tmp_path / "guest"
    with importlib.resources.as_file(GUEST_TREE) as tree:
        shutil.copytree(tree, copy)
    packaged = key_of(GUEST_TREE)
    assert key_of(copy) == packaged                      # the same files: the same image
    rc = copy / "etc" / "accelmig" / "rc"
    original = rc.read_text()
    rc.write_text(original + "# one more line\n")
    assert key_of(copy) != packaged
    rc.write_text(original)
    assert key_of(copy) == packaged
    (copy / "etc" / "accelmig" / "init.d" / "70-extra").write_text("#!/bin/sh\n")
    assert key_of(copy) != packaged                      # a new service is a new image too

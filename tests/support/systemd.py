"""systemd's own checks of a rendered unit file, offline: ``systemd-analyze
verify`` (clean means exit 0 *and* nothing said: an unknown key or a bad
value is only a warning on stderr) and ``systemd-analyze security
--offline=true`` (the exposure score).  Without systemd-analyze (or one too
old for --offline, before systemd 250) the tests that need it are skipped
loudly."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="SKIPPED LOUDLY: systemd-analyze is not installed")


def verify(unit: Path) -> str:
    """Run ``systemd-analyze verify``; assert it is clean; return what it said."""
    done = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and said == "", f"systemd-analyze verify {unit}: exit {done.returncode}\n{said}"
    return said


def exposure(unit: Path) -> float:
    """``systemd-analyze security --offline=true``'s overall exposure level (0-10)."""
    done = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=60)
    if "--offline" in done.stderr and done.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: this systemd-analyze has no --offline: {done.stderr.strip()}")
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert found, f"no exposure level in:\n{done.stdout}\n{done.stderr}"
    return float(found.group(1))


def directives(text: str) -> dict[str, list[str]]:
    """KEY -> every value it is given in a unit's text (comments skipped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out

"""Bring the virtual environment this runs in to the lock: every locked package at its
locked version, nothing else installed beside them, and fedpeft itself installed editable
from this checkout.

    .venv/bin/python scripts/sync_venv.py requirements.lock

The lock (written by ``scripts/lock.sh``) pins every package with its hashes, so pip
installs it with ``--require-hashes --no-deps``: exactly the files the suite passed with,
nothing resolved anew. A package installed by hand, or left by an older lock, is removed,
so that a stale environment cannot hide a drift. An environment already in sync costs a
look at its installed metadata and nothing else. Standard library only (it runs before
anything is installed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

#: installed beside the locked packages and kept: the installer itself and the project
KEEP = {"pip", "fedpeft"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares names (``PyYAML`` = ``pyyaml``, ``a_b`` = ``a-b``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of the lock (hash lines and
    comments skipped)."""
    pins = {}
    for number, line in enumerate(lock.read_text().splitlines(), 1):
        match = PIN.match(line)
        if match:
            pins[canonical(match[1])] = match[2]
        elif line and not line.startswith((" ", "#", "\t")):
            raise SystemExit(f"{lock}:{number}: not a 'name==version' pin: {line!r}")
    return pins


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def editable_here(root: Path) -> bool:
    """Whether fedpeft is installed editable from ``root`` (its ``direct_url.json``)."""
    try:
        url = metadata.distribution("fedpeft").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    info = json.loads(url or "{}")
    return info.get("dir_info", {}).get("editable", False) and info.get("url") == root.resolve().as_uri()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def main(lock: Path) -> None:
    root = lock.resolve().parent
    pins, have = locked(lock), installed()
    wrong = sorted(n for n, v in pins.items() if have.get(n) != v)
    extra = sorted(n for n in have if n not in pins and n not in KEEP)
    if wrong:
        shown = ", ".join(f"{n} {have.get(n, '(none)')} -> {pins[n]}" for n in wrong[:8])
        more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        print(f"[setup] {len(wrong)} package(s) to the lock: {shown}{more}", flush=True)
        pip("install", "-q", "--require-hashes", "--no-deps", "-r", str(lock))
    if extra:
        print(f"[setup] removing what the lock does not have: {', '.join(extra)}", flush=True)
        pip("uninstall", "-q", "-y", *extra)
    stamp = Path(sys.prefix) / ".fedpeft-installed"
    pyproject = root / "pyproject.toml"
    if not editable_here(root) or not stamp.exists() or pyproject.stat().st_mtime > stamp.stat().st_mtime:
        print("[setup] installing fedpeft (editable) from this checkout", flush=True)
        # no build isolation: the locked setuptools builds it, nothing fetched that the lock lacks
        pip("install", "-q", "--no-deps", "--no-build-isolation", "-e", str(root))
        stamp.touch()
    now = installed()
    still = sorted(n for n, v in pins.items() if now.get(n) != v)
    if still:
        raise SystemExit(f"[setup] {lock}: still not as locked after installing: {', '.join(still)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/sync_venv.py LOCKFILE")
    main(Path(sys.argv[1]))

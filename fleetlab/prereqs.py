"""What the lab needs on the control machine, checked before anything is touched.

Each missing piece is named exactly, with the Debian package that provides it, so the error ends
in one ``apt-get install`` line an operator (or CI) can run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetlab.errors import LabError


@dataclass(frozen=True)
class Missing:
    """One prerequisite that is not there: what it is, and the apt package that provides it."""

    what: str
    apt_package: str | None

    def __str__(self) -> str:
        return self.what


#: Executables the lab runs, and the Debian package each comes from.
REQUIRED_TOOLS: dict[str, str] = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "gcc": "gcc",
    "ssh-keygen": "openssh-client",
    "mount": "mount",
    "ldconfig": "libc-bin",
    "dpkg-scanpackages": "dpkg-dev",
    "gpg": "gnupg",
    "nft": "nftables",  # the air gap (airgap.py)
}


def _overlay_supported(filesystems: Path) -> bool:
    """Whether the kernel knows overlayfs (listed once the module is loaded or built in)."""
    try:
        text = filesystems.read_text()
    except OSError:
        return False
    return any(line.split()[-1] == "overlay" for line in text.splitlines() if line.strip())


def check_prereqs(
    which: Callable[[str], str | None] = shutil.which,
    euid: Callable[[], int] = os.geteuid,
    filesystems: Path = Path("/proc/filesystems"),
    tools: Sequence[str] | None = None,
) -> list[Missing]:
    """List every missing prerequisite (empty when the lab can run here).

    The callables are parameters so the check itself can be tested without changing the machine.
    """
    missing: list[Missing] = []
    if euid() != 0:
        missing.append(Missing("root: the lab mounts overlays and boots containers; run it as root", None))
    for tool in tools if tools is not None else REQUIRED_TOOLS:
        if which(tool) is None:
            missing.append(Missing(f"{tool} (not on PATH)", REQUIRED_TOOLS.get(tool)))
    if not _overlay_supported(filesystems):
        missing.append(Missing("overlayfs (not in /proc/filesystems): run `modprobe overlay`", None))
    return missing


def describe_missing(missing: Sequence[Missing]) -> str:
    """One message naming every missing piece and the apt-get line that installs the packages."""
    lines = ["The lab cannot run on this machine; missing:"]
    lines += [f"  - {m}" for m in missing]
    packages = sorted({m.apt_package for m in missing if m.apt_package})
    if packages:
        lines.append(f"Install with: apt-get install -y {' '.join(packages)}")
    return "\n".join(lines)


def require_prereqs() -> None:
    """Raise ``LabError`` naming what is missing, before any host is touched."""
    missing = check_prereqs()
    if missing:
        raise LabError(describe_missing(missing))


#: ``fs.inotify.max_user_instances``: every booted host's systemd, journald, logind and sshd take
#: inotify instances from root's shared budget (about 8 per host, measured on the bookworm base);
#: the kernel's default of 128 runs out near 15 hosts, and a host then hangs in boot with no
#: message. The lab raises the limit (it already needs root) and never lowers it.
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_PER_HOST = 8
INOTIFY_HEADROOM = 128


def inotify_instances_needed(hosts: int) -> int:
    """The ``max_user_instances`` for ``hosts`` booted hosts, with headroom for the machine."""
    return INOTIFY_HEADROOM + INOTIFY_PER_HOST * hosts


def running_nspawn_hosts(proc: Path = Path("/proc")) -> int:
    """How many ``systemd-nspawn`` containers run on this machine now (other labs included)."""
    count = 0
    for comm in proc.glob("[0-9]*/comm"):
        try:
            count += comm.read_text().strip() == "systemd-nspawn"
        except OSError:
            continue  # the process ended while we looked
    return count


def ensure_inotify_instances(hosts: int, path: Path = INOTIFY_INSTANCES) -> str | None:
    """Raise the inotify instance limit for ``hosts`` booted hosts if it is lower; say what changed."""
    needed = inotify_instances_needed(hosts)
    try:
        current = int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # not Linux's procfs layout: nothing to check
    if current >= needed:
        return None
    try:
        path.write_text(f"{needed}\n")
    except OSError as exc:
        raise LabError(
            f"{hosts} lab hosts need fs.inotify.max_user_instances >= {needed} (now {current}) and it "
            f"cannot be raised here ({exc.strerror}); run: sysctl -w fs.inotify.max_user_instances={needed}"
        ) from exc
    return f"raised fs.inotify.max_user_instances from {current} to {needed} for {hosts} hosts"

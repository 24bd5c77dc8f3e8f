"""Mounts the lab makes: overlay root filesystems, and finding/removing what is left under a path.

The lab must never leave a mount behind, so teardown asks the kernel (``/proc/self/mountinfo``)
what is mounted under a directory rather than trusting its own records.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from fleetlab.errors import LabError


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` for a space, ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Path]:
    """Every mount point of this mount namespace, in mount order."""
    return [Path(_unescape(line.split()[4])) for line in mountinfo.read_text().splitlines() if line]


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first (the order to unmount them)."""
    base = path.resolve()
    found = [m for m in mount_points() if m == base or base in m.parents]
    return sorted(found, key=lambda m: len(m.parts), reverse=True)


def is_mounted(path: Path) -> bool:
    """Whether ``path`` itself is a mount point."""
    return path.resolve() in mount_points()


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """Mount an overlay of the read-only ``lower`` with writable ``upper`` at ``target``."""
    for d in (upper, work, target):
        d.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    result = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise LabError(
            f"could not mount the overlay root at {target}: {result.stderr.strip()}. "
            "The lab needs overlayfs (modprobe overlay) and a state dir on a filesystem that supports "
            "it as upper layer (ext4, xfs; not another overlay)"
        )


def unmount_all_under(path: Path, attempts: int = 5) -> None:
    """Unmount everything at or below ``path``; lazily as a last resort; raise if any remain."""
    for attempt in range(attempts):
        remaining = mounts_under(path)
        if not remaining:
            return
        for m in remaining:
            lazy = ["-l"] if attempt == attempts - 1 else []
            subprocess.run(["umount", *lazy, str(m)], capture_output=True, check=False)
        time.sleep(0.2 * attempt)
    left = mounts_under(path)
    if left:
        raise LabError(f"still mounted after unmounting: {', '.join(map(str, left))}; try `umount -l` on them")

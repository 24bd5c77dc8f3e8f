"""Pure verdicts: a host's copy against the manifest, the disk-space check, a transfer's rate.

Nothing here does I/O; ``fleet.weights.stage`` gathers the facts and acts on the answers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.weights.manifest import FileEntry, Manifest


class FileState(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    TRUNCATED = "truncated"  #: shorter than the manifest says (an interrupted copy)
    OVERSIZED = "oversized"  #: longer than the manifest says
    CORRUPTED = "corrupted"  #: the right size, another SHA-256

    @property
    def resend(self) -> bool:
        return self is not FileState.OK


@dataclass(frozen=True)
class HostFile:
    """What the host holds at a manifest path: size and SHA-256 (None: not hashed)."""

    size: int
    sha256: str | None


def file_state(want: FileEntry, have: HostFile | None) -> FileState:
    if have is None:
        return FileState.MISSING
    if have.size < want.size:
        return FileState.TRUNCATED
    if have.size > want.size:
        return FileState.OVERSIZED
    if have.sha256 != want.sha256:
        return FileState.CORRUPTED
    return FileState.OK


@dataclass(frozen=True)
class CopyVerdict:
    """A host's copy of one snapshot against the manifest."""

    states: tuple[tuple[FileEntry, FileState], ...]
    refs_main: str | None  #: what ``refs/main`` names on the host now
    revision: str  #: the manifest's snapshot

    @property
    def to_send(self) -> tuple[FileEntry, ...]:
        return tuple(f for f, s in self.states if s.resend)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size for f in self.to_send)

    @property
    def complete(self) -> bool:
        """Every file present with the manifest's size and SHA-256."""
        return not self.to_send

    @property
    def current(self) -> bool:
        """Complete, and ``refs/main`` names it: the units load exactly the manifest's files."""
        return self.complete and self.refs_main == self.revision

    def damaged(self) -> list[str]:
        """``path (state)`` of every file that is there but wrong, for reports."""
        return [f"{f.path} ({s.value})" for f, s in self.states if s.resend and s is not FileState.MISSING]

    def missing(self) -> int:
        return sum(1 for _f, s in self.states if s is FileState.MISSING)


def verdict(manifest: Manifest, listing: Mapping[str, HostFile], refs_main: str | None) -> CopyVerdict:
    """Each manifest file's state on the host. Files the manifest does not name are left alone
    (the units read only what the model's index names; pruning is a separate decision)."""
    states = tuple((f, file_state(f, listing.get(f.path))) for f in manifest.files)
    return CopyVerdict(states, refs_main, manifest.revision)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def space_refusal(need: int, free: int, where: str) -> str | None:
    """Why the copy cannot start (no space for ``need`` bytes where ``free`` are left), or None.

    Each file is written beside the one it replaces and renamed over it, so a damaged file's
    bytes are freed only after its new copy is complete: every byte to send needs room."""
    if need <= free:
        return None
    return (
        f"No space left on device (ENOSPC): the copy needs {fmt_bytes(need)} ({need} bytes), "
        f"{fmt_bytes(free)} ({free} bytes) free on the filesystem of {where}; nothing was sent. "
        "Free space there (or mount a larger disk) and stage again"
    )


@dataclass(frozen=True)
class Rate:
    """A transfer's progress: bytes per second so far and the seconds left at that rate."""

    done: int
    total: int
    elapsed: float

    @property
    def per_second(self) -> float | None:
        return self.done / self.elapsed if self.elapsed > 0 and self.done > 0 else None

    @property
    def eta(self) -> float | None:
        rate = self.per_second
        if self.done >= self.total:
            return 0.0
        return (self.total - self.done) / rate if rate else None

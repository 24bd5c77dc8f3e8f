"""Removing a lab's directory while the caller goes on: renamed aside at once, deleted in the background.

A lab's state directory holds each host's overlay upper layer: everything a host wrote. For a
host that ran the real engine that is the release (vLLM's CPU build with torch: 62,562 files,
2.5 GB) and its caches, and deleting it took 11-135 s of disk time on the shared development
machine (docs/real-engine.md), none of it CPU. ``lab.down`` has stopped the hosts and checked that
nothing is mounted under the directory before it asks for the removal, so nothing uses it any more:
:class:`BackgroundRemoval` renames it to a hidden sibling (one ``rename(2)`` on the same
filesystem: the lab's own path is free at once, and never holds a half-deleted tree) and starts
``rm -rf --one-file-system`` on that in a process of its own. :meth:`BackgroundRemoval.wait` waits
for every one and says what is still there; whoever started them calls it before it ends (the
tests: ``pytest_sessionfinish`` in ``tests/lab/conftest.py``). The ``rm`` runs in a session of its
own: should the caller be killed first, it still runs to the end.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

#: The prefix of a directory being removed (a sibling of the lab's directory, hidden).
ASIDE_PREFIX = ".removing-"


@dataclass
class _Pending:
    path: Path
    proc: subprocess.Popen[bytes]


@dataclass
class BackgroundRemoval:
    """``remove`` for ``fleetlab.lab.down``: the directory renamed aside and deleted in the background."""

    _pending: list[_Pending] = field(default_factory=list)
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def aside_path(self, path: Path) -> Path:
        return path.with_name(f"{ASIDE_PREFIX}{path.name}-{os.getpid()}-{next(self._counter)}")

    def __call__(self, path: Path) -> None:
        aside = self.aside_path(path)
        os.rename(path, aside)
        proc = subprocess.Popen(
            ["rm", "-rf", "--one-file-system", "--", str(aside)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self._pending.append(_Pending(aside, proc))

    @property
    def pending(self) -> list[Path]:
        """The directories whose removal has not been waited for yet."""
        return [p.path for p in self._pending]

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for every removal started; return a line for each directory that is still there."""
        problems = []
        while self._pending:
            p = self._pending.pop(0)
            try:
                _out, err = p.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                problems.append(f"{p.path}: still being removed (rm -rf, pid {p.proc.pid}) after {timeout:.0f} s")
                continue
            if p.path.exists():
                why = err.decode(errors="replace").strip()[-500:] or f"rm -rf exited {p.proc.returncode}"
                problems.append(f"{p.path}: not removed: {why}")
        return problems

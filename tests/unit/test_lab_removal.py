"""Removing a lab's directory in the background (``fleetlab.removal``): the path free at once, the
tree deleted by the time ``wait`` returns, and a tree that cannot go named instead of hidden."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetlab.removal import ASIDE_PREFIX, BackgroundRemoval


def _tree(root: Path, files: int = 200) -> Path:
    for i in range(files):
        d = root / f"d{i % 10}" / "sub"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(b"x" * 100)
    return root


def test_the_lab_path_is_free_at_once_and_the_tree_gone_after_wait(tmp_path: Path) -> None:
    lab = _tree(tmp_path / "state" / "pr123")
    removal = BackgroundRemoval()
    removal(lab)
    assert not lab.exists()  # renamed aside: a new lab of that name can be made now
    (aside,) = removal.pending
    assert aside.parent == lab.parent and aside.name.startswith(f"{ASIDE_PREFIX}pr123-{os.getpid()}-")
    lab.mkdir()  # the next `up` of the same name
    assert removal.wait() == []
    assert not aside.exists() and removal.pending == []
    assert sorted(p.name for p in lab.parent.iterdir()) == ["pr123"]  # the new one is untouched


def test_two_removals_of_the_same_name_do_not_collide(tmp_path: Path) -> None:
    removal = BackgroundRemoval()
    for _ in range(2):
        removal(_tree(tmp_path / "lab", files=20))
    assert len(set(removal.pending)) == 2
    assert removal.wait() == [] and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_mount_left_inside_is_not_crossed_and_is_named(tmp_path: Path) -> None:
    """``rm --one-file-system``: a filesystem still mounted under the directory (``lab.down`` checks
    there is none before it asks) is left alone, and ``wait`` says what was left and why."""
    lab = _tree(tmp_path / "lab", files=20)
    mnt = lab / "d0" / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "fleet-test", str(mnt)], check=True)
    removal = BackgroundRemoval()
    try:
        (mnt / "kept").write_text("on another filesystem")
        removal(lab)
        (aside,) = removal.pending
        mnt = aside / "d0" / "mnt"  # the mount moved with its directory
        (problem,) = removal.wait()
        assert problem.startswith(f"{aside}: not removed: ") and "mnt" in problem, problem
        assert (mnt / "kept").read_text() == "on another filesystem"
    finally:
        removal.wait()
        subprocess.run(["umount", str(mnt)], check=True)
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(tmp_path / "lab"), *map(str, tmp_path.glob(".*"))],
                       check=False)  # fmt: skip
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(tmp_path) in line]

"""``fleet.localfs.atomic_write``: the control machine's one atomic-write helper, on a real
filesystem (tmp_path): content and mode after, nothing half-written or left behind when a step
fails, a symlink at the destination replaced (not followed), a private file never wider than
0600 at any step."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from fleet.localfs import atomic_write


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize(
    ("data", "mode", "content"),
    [
        (b"\x00\xffbytes", 0o644, b"\x00\xffbytes"),
        ("text \u00e9\n", 0o644, "text \u00e9\n".encode()),
        ("secret=1\n", 0o600, b"secret=1\n"),
        (b"", 0o640, b""),
        (b"read-only", 0o444, b"read-only"),
        (b"owner read only", 0o400, b"owner read only"),
    ],
)
@pytest.mark.parametrize("before", [None, b"old content, longer than the new one " * 40])
def test_content_and_mode_after(
    tmp_path: Path, data: bytes | str, mode: int, content: bytes, before: bytes | None
) -> None:
    path = tmp_path / "f.conf"
    if before is not None:
        path.write_bytes(before)
        path.chmod(0o666)
    atomic_write(path, data, mode=mode)
    assert path.read_bytes() == content
    assert _mode(path) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.conf"]  # no temporary left


def test_the_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "wide", b"x", mode=0o644)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "wide") == 0o644


def test_accepts_a_str_path_and_fsync_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    atomic_write(str(tmp_path / "cache.json"), "{}", fsync=False)
    assert (tmp_path / "cache.json").read_text() == "{}"
    assert synced == []


def test_fsync_of_the_file_and_optionally_of_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        kinds.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    atomic_write(tmp_path / "a", b"a")
    assert kinds == ["file"]
    kinds.clear()
    atomic_write(tmp_path / "b", b"b", sync_dir=True)
    assert kinds == ["file", "dir"]


class Boom(Exception):
    pass


def _raise(*_args: Any, **_kwargs: Any) -> None:
    raise Boom


@pytest.mark.parametrize("step", ["fchmod", "fsync", "replace"])
@pytest.mark.parametrize("existed", [True, False])
def test_a_failure_mid_way_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, existed: bool
) -> None:
    path = tmp_path / "haproxy.cfg"
    if existed:
        path.write_bytes(b"old")
        path.chmod(0o644)
    monkeypatch.setattr(os, step, _raise)
    with pytest.raises(Boom):
        atomic_write(path, b"new " * 10_000, mode=0o600)
    monkeypatch.undo()
    if existed:
        assert path.read_bytes() == b"old" and _mode(path) == 0o644
        assert sorted(p.name for p in tmp_path.iterdir()) == ["haproxy.cfg"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_a_failing_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write itself fails (as on a full disk): the file object's write raises."""
    path = tmp_path / "state"
    path.write_bytes(b"old")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def fileno(self) -> int:
            return int(self.f.fileno())

        def write(self, _data: bytes) -> int:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_directory_at_the_destination_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write(tmp_path / "d", b"x")
    assert (tmp_path / "d").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_missing_directory_is_an_oserror_not_a_creation(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "no" / "f", b"x")
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_at_the_destination_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"must stay")
    target.chmod(0o644)
    link = tmp_path / "dir" / "haproxy.cfg"
    link.parent.mkdir()
    link.symlink_to(target)
    atomic_write(link, b"new", mode=0o600)
    assert not link.is_symlink() and stat.S_ISREG(link.lstat().st_mode)
    assert link.read_bytes() == b"new" and _mode(link) == 0o600
    assert target.read_bytes() == b"must stay" and _mode(target) == 0o644


def test_a_dangling_symlink_at_the_destination_creates_nothing_at_its_target(tmp_path: Path) -> None:
    link = tmp_path / "f"
    link.symlink_to(tmp_path / "would-be-created")
    atomic_write(link, b"x")
    assert not (tmp_path / "would-be-created").exists()
    assert link.read_bytes() == b"x" and not link.is_symlink()


def test_the_temporary_is_in_the_same_directory_with_a_unique_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    real = tempfile.mkstemp

    def spy(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real(*args, **kwargs)
        made.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", spy)
    path = tmp_path / ("n" * 250)  # a name near NAME_MAX: the temporary's must still fit
    atomic_write(path, b"1")
    atomic_write(path, b"2")
    assert len(made) == 2 and made[0] != made[1]
    assert all(Path(m).parent == tmp_path for m in made)
    assert all(Path(m).name.startswith(".") for m in made)  # hidden, as the old temporaries were
    assert path.read_bytes() == b"2"


def test_a_private_file_is_never_wider_than_0600_at_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The env file's case: 0600 from the temporary's creation through the data's write and
    fsync to the rename, even over an existing world-readable file."""
    path = tmp_path / "vllm-0.env"
    path.write_bytes(b"OLD=1\n")
    path.chmod(0o644)
    seen: dict[str, int] = {}
    real_mkstemp, real_fsync, real_replace = tempfile.mkstemp, os.fsync, os.replace

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        seen["created"] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd, name

    def fsync(fd: int) -> None:
        seen["written"] = stat.S_IMODE(os.fstat(fd).st_mode)
        seen["size"] = os.fstat(fd).st_size
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        seen["renamed"] = _mode(Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(path, "API_KEY=secret\n", mode=0o600)
    assert seen == {"created": 0o600, "written": 0o600, "size": 15, "renamed": 0o600}
    assert _mode(path) == 0o600 and path.read_text() == "API_KEY=secret\n"


def test_a_reader_sees_the_old_content_or_the_new_never_a_part(tmp_path: Path) -> None:
    path = tmp_path / "planning.json"
    versions = [bytes([65 + i]) * 200_000 for i in range(4)]
    atomic_write(path, versions[0])
    stop = threading.Event()
    torn: list[int] = []

    def read() -> None:
        while not stop.is_set():
            got = path.read_bytes()
            if got not in versions:
                torn.append(len(got))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            atomic_write(path, versions[i % 4], fsync=False)
    finally:
        stop.set()
        reader.join()
    assert torn == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planning.json"]

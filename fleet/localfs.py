"""Files on this machine (the one running ``fleet``), written atomically: the one helper for it.

:func:`atomic_write` is how the control side replaces a file that something else may read at the
same time (HAProxy's configuration and server-state file, the store's planning files a plan
reads, the manifest's hash cache, rendered and exported trees, the audit's HTML report): a reader
sees the old content or the new, never a part.

How (POSIX ``rename(2)``; CPython's ``tempfile.mkstemp`` and ``os.replace``):

1. a temporary file in the destination's own directory (a rename is atomic only within one
   filesystem), with a unique name (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``, plus
   ``O_NOFOLLOW`` where the platform has it), so two writers never share one and nothing is ever
   written through a symlink someone left at the temporary name: ``O_EXCL`` refuses any existing
   name, a symlink included;
2. its mode set with ``fchmod`` before the first byte is written: ``mkstemp`` creates it 0600,
   so a private file (0600) is never readable by anyone else, not even for a moment, and the
   mode is exactly ``mode`` (the umask does not narrow it, as it would ``open``'s);
3. the data written and, by default, ``fsync``-ed, so after a crash the name holds the old
   content or the whole new one (ext4, XFS: a rename can reach the disk before the data);
4. ``os.replace``: one ``rename(2)`` over the destination. A symlink at the destination is
   **replaced, not followed**: the name becomes the new regular file and the link's target is
   left untouched. The new file is a new inode owned by this process's user;
5. optionally (``sync_dir``) an ``fsync`` of the directory, which makes the rename itself
   durable.

On any failure (the write, the fsync, the rename, an interrupt) the temporary file is removed and
the exception propagates; the destination is as it was. Errors are the ``OSError`` of the step
that failed: callers word them for people.

Scripts fleet ships to hosts keep their own copy (``fleet.gpuwatch.watcher.atomic_write``, the
weights scripts): they run on a host's ``python3`` without fleet installed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "sync_directory"]

#: How much of the destination's name goes into the temporary's (``.NAME.XXXXXXXX.tmp``); the
#: rest is cut so the temporary's name stays under ``NAME_MAX`` (255 bytes) whatever ``NAME`` is.
_NAME_PART = 48


def sync_directory(directory: str | os.PathLike[str]) -> None:
    """``fsync`` of a directory: the renames and creations in it reach the disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    mode: int = 0o644,
    fsync: bool = True,
    sync_dir: bool = False,
) -> None:
    """Replace ``path`` with ``data`` (``str``: UTF-8) atomically, with exactly ``mode``.

    See the module docstring: a unique temporary beside ``path`` (never written through a
    symlink), ``fchmod`` to ``mode`` before the first byte, ``fsync`` (unless ``fsync=False``:
    for files that are cheap to make again), ``os.replace`` (a symlink at ``path`` is replaced,
    not followed), and an ``fsync`` of the directory when ``sync_dir``. The directory must
    exist. On failure the temporary is removed, ``path`` is unchanged and the ``OSError``
    propagates.
    """
    dest = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name[:_NAME_PART]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(payload)
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        sync_directory(dest.parent)

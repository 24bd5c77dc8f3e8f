"""Files on hosts, written atomically with their owner and mode from the first byte.

pyinfra's ``files.put`` uploads to a temporary file, moves it into place, then changes its mode:
for a moment a secret would sit at its final path (and in the temporary dir) with the default
mode. Here the content travels on the command's stdin (never in argv), is written under
``umask 077`` to a temporary name beside the target, given its owner and mode, and renamed over
the target with ``mv -T`` (one ``rename(2)``: readers see the old file or the new one).
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import shlex
from collections.abc import Generator
from typing import Any

from pyinfra.api.command import StringCommand
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.files import File, Sha1File

#: What an operation generator yields.
Commands = Generator[str | StringCommand, Any, None]

#: Run by ``sh -c`` with the values as positional arguments (never interpolated into the script).
_WRITE = (
    'set -e; mkdir -p -- "$1"; umask 077; tmp="$1/.$2.fleet-tmp"; rm -f -- "$tmp"; '
    'base64 -d > "$tmp"; chown -- "$3" "$tmp"; chmod -- "$4" "$tmp"; mv -fT -- "$tmp" "$1/$2"'
)


def stat_mode(mode: int) -> int:
    """pyinfra's ``File`` fact spells mode 0o644 as the integer 644."""
    return int(f"{mode:o}")


def write_command(path: str, content: bytes, mode: int, user: str, group: str) -> StringCommand:
    """The command that writes ``content`` to ``path`` atomically (content on stdin, base64)."""
    directory, name = posixpath.split(path)
    argv = ["sh", "-c", _WRITE, "fleet-write", directory, name, f"{user}:{group}", f"{mode:o}"]
    return StringCommand(shlex.join(argv), _stdin=base64.encodebytes(content).decode())


@operation()
def atomic_file(
    path: str, content: str | bytes, mode: int = 0o644, user: str = "root", group: str = "root"
) -> Commands:
    """
    Make ``path`` hold ``content`` with ``user:group`` and ``mode``, replacing it atomically.

    + path: absolute path on the host
    + content: the file's text or bytes
    + mode: permission bits, e.g. ``0o600`` for files holding secrets
    + user: owner
    + group: group
    """
    if not posixpath.isabs(path) or path.endswith("/"):
        raise ValueError(f"atomic_file needs an absolute file path, not {path!r}")
    data = content.encode() if isinstance(content, str) else content
    remote_sha = host.get_fact(Sha1File, path=path)
    if remote_sha != hashlib.sha1(data).hexdigest():
        yield write_command(path, data, mode, user, group)
        return
    info = host.get_fact(File, path=path)
    if not info:
        yield write_command(path, data, mode, user, group)
        return
    fixes = []
    if info["user"] != user or info["group"] != group:
        fixes.append(shlex.join(["chown", f"{user}:{group}", "--", path]))
    if info["mode"] != stat_mode(mode):
        fixes.append(shlex.join(["chmod", f"{mode:o}", "--", path]))
    if not fixes:
        host.noop(f"{path} is up to date")
    yield from fixes

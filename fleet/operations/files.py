"""Files on hosts, written atomically with their owner and mode from the first byte.

pyinfra's ``files.put`` uploads to a temporary file, moves it into place, then changes its mode:
for a moment a secret would sit at its final path (and in the temporary dir) with the default
mode. Here the content travels on the command's stdin (never in argv), is written under
``umask 077`` to a temporary name beside the target, given its owner and mode, and renamed over
the target with ``mv -T`` (one ``rename(2)``: readers see the old file or the new one).

An operation with several files writes them in one command (``write_many_command``: each file
still its own temporary name, owner, mode and rename), having read every file's facts before it
(``files_plan`` decides from them): in ``fleet deploy`` each command is a ``sudo sh -c`` round
trip, and each fact read after a command another.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
import shlex
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.command import StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.files import Directory, File, Sha1File

from fleet.facts.batch import FactRequest

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
    _check_path(path)
    data = content.encode() if isinstance(content, str) else content
    remote_sha = host.get_fact(Sha1File, path=path)
    if remote_sha != hashlib.sha1(data).hexdigest():
        yield write_command(path, data, mode, user, group)
        return
    info = host.get_fact(File, path=path)
    if not info:
        yield write_command(path, data, mode, user, group)
        return
    fixes = _fixes(path, info, mode, user, group)
    if not fixes:
        host.noop(f"{path} is up to date")
    yield from fixes


#: Writes several files from one stdin, each as ``_WRITE`` writes one: the positional arguments
#: are (dir, name, owner, mode) per file; stdin holds, per file, a line ``<base64 length> <size>``
#: then exactly that many base64 characters. ``read`` takes the short line byte by byte and
#: ``head -c`` (GNU coreutils: it never reads past the count it is given) the content, so each
#: file's bytes end where the next file's line begins. A file whose decoded size is not the one
#: announced (a cut stdin) is removed, not renamed into place.
_WRITE_MANY = (
    'set -e; while [ "$#" -ge 4 ]; do IFS=" " read -r n size; mkdir -p -- "$1"; tmp="$1/.$2.fleet-tmp"; '
    'rm -f -- "$tmp"; (umask 077; head -c "$n" | base64 -d > "$tmp"); '
    'if [ "$(wc -c < "$tmp")" -ne "$size" ]; then rm -f -- "$tmp"; echo "fleet-write: $1/$2: input cut short" >&2; '
    'exit 1; fi; chown -- "$3" "$tmp"; chmod -- "$4" "$tmp"; mv -fT -- "$tmp" "$1/$2"; shift 4; done'
)


@dataclass(frozen=True)
class Wanted:
    """A file as it should be on the host: what ``atomic_file`` takes."""

    path: str
    content: str | bytes
    mode: int = 0o644
    user: str = "root"
    group: str = "root"

    @property
    def data(self) -> bytes:
        return self.content.encode() if isinstance(self.content, str) else self.content


def write_many_command(files: Sequence[Wanted]) -> StringCommand:
    """One command that writes every one of ``files`` as ``write_command`` writes one (each its own
    temporary file, owner, mode and ``rename(2)``, in the order given; contents on stdin, base64)."""
    argv = ["sh", "-c", _WRITE_MANY, "fleet-write"]
    stdin = []
    for f in files:
        _check_path(f.path)
        directory, name = posixpath.split(f.path)
        argv += [directory, name, f"{f.user}:{f.group}", f"{f.mode:o}"]
        encoded = base64.b64encode(f.data).decode()
        stdin.append(f"{len(encoded)} {len(f.data)}\n{encoded}")
    return StringCommand(shlex.join(argv), _stdin="".join(stdin))


def write_many(files: Sequence[Wanted]) -> tuple[str, str]:
    """:func:`write_many_command` as (its shell text, its stdin), to join with other commands."""
    command = write_many_command(files)
    return command.get_raw_value(), str(command.connector_arguments["_stdin"])


def _check_path(path: str) -> None:
    if not posixpath.isabs(path) or path.endswith("/"):
        raise ValueError(f"atomic_file needs an absolute file path, not {path!r}")


def file_requests(files: Sequence[Wanted]) -> list[FactRequest]:
    """What deciding ``files`` reads of the host (``fleet.deploy.prefetch`` brings the same)."""
    return [FactRequest(fact, {"path": f.path}) for f in files for fact in (Sha1File, File)]


def read_together(requests: Sequence[FactRequest]) -> list[Any]:
    """Each request's value (``host.get_fact``), all read before the operation yields its first
    command: in ``fleet deploy`` those reads are one round trip (``fleet.deploy.factcache`` reads
    an operation's facts ahead), where a read after a command is one of its own."""
    return [host.get_fact(r.fact, **r.kwargs) for r in requests]


@dataclass
class FilesPlan:
    """What makes ``files`` right on the host: the files whose content is written, and fixes of
    owner or mode (``chown``/``chmod``) where only those differ."""

    writes: list[Wanted] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  #: paths written or fixed, in order

    def commands(self) -> tuple[list[str], str | None]:
        """The shell commands, writes first, each of which must succeed before the next runs, and
        what the writes read on stdin (the contents, base64: never on argv), made once."""
        if not self.writes:
            return list(self.fixes), None
        write, stdin = write_many(self.writes)
        return [write, *self.fixes], stdin


def joined(parts: Sequence[str], stdin: str | None) -> StringCommand:
    """One command running ``parts`` in order, each only once the one before it succeeded (one
    round trip where each part would be one); ``stdin`` goes to the first part that reads it."""
    text = " && ".join(parts)
    return StringCommand(text, _stdin=stdin) if stdin is not None else StringCommand(text)


def files_plan(files: Sequence[Wanted], values: Sequence[Any]) -> FilesPlan:
    """Pure: what ``files`` need, given ``values`` (the facts of :func:`file_requests`, in order)."""
    plan = FilesPlan()
    for i, f in enumerate(files):
        _check_path(f.path)
        sha, info = values[2 * i], values[2 * i + 1]
        if sha != hashlib.sha1(f.data).hexdigest() or not info:
            plan.writes.append(f)
            plan.changed.append(f.path)
            continue
        fixes = _fixes(f.path, info, f.mode, f.user, f.group)
        if fixes:
            plan.fixes += fixes
            plan.changed.append(f.path)
    return plan


def _fixes(path: str, info: Mapping[str, Any], mode: int, user: str, group: str) -> list[str]:
    fixes = []
    if info["user"] != user or info["group"] != group:
        fixes.append(shlex.join(["chown", f"{user}:{group}", "--", path]))
    if info["mode"] != stat_mode(mode):
        fixes.append(shlex.join(["chmod", f"{mode:o}", "--", path]))
    return fixes


@dataclass(frozen=True)
class WantedDir:
    """A directory that should exist; with ``mode`` (and its owner) when they matter."""

    path: str
    mode: int | None = None
    user: str = "root"
    group: str = "root"


def directories_plan(dirs: Sequence[WantedDir], values: Sequence[Any]) -> list[str]:
    """Pure: the commands that make ``dirs`` right, given their ``Directory`` facts (in order):
    a missing one made with its mode and owner, a present one's mode or owner fixed where given.
    A path that is there but no directory is an error, as pyinfra's ``files.directory`` makes it."""
    out: list[str] = []
    for d, info in zip(dirs, values, strict=True):
        if info is False:
            raise OperationError(f"{d.path} exists and is not a directory; move it away and deploy again")
        if info is None:
            mode = ["-m", f"{d.mode:o}"] if d.mode is not None else []
            out.append(shlex.join(["mkdir", "-p", *mode, "--", d.path]))
            if d.mode is not None:
                out.append(shlex.join(["chown", f"{d.user}:{d.group}", "--", d.path]))
        elif d.mode is not None:
            out += _fixes(d.path, info, d.mode, d.user, d.group)
    return out


@operation()
def directories(dirs: Sequence[WantedDir]) -> Commands:
    """
    Make ``dirs`` exist with their modes and owners, in one command (their facts read together).

    + dirs: the directories
    """
    found = read_together([FactRequest(Directory, {"path": d.path}) for d in dirs])
    parts = directories_plan(dirs, found)
    if parts:
        yield joined(parts, None)
    else:
        host.noop(f"{len(dirs)} director{'y' if len(dirs) == 1 else 'ies'} in place")

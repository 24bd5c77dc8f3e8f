"""Escaping where values land: systemd unit directives, systemd environment files, shell commands.

Values are validated where they enter (``fleet.inventory``); here they are escaped for the
place they are written, so that a value is always read back as exactly that value and can never
add a line, a directive, an argument or a specifier. Rules from systemd.syntax(7) "Quoting",
systemd.unit(5) "Specifiers", systemd.service(5) "Command lines" and systemd.exec(5)
"EnvironmentFile=" (systemd 252, Debian 12); the lab test loads rendered units into a real
systemd and reads the values back.

* ``%`` starts a specifier in every directive that takes a value: always doubled.
* ``ExecStart=`` words: ``$`` starts a variable, so ``$$``; a word that is not plain is written
  in double quotes with C escapes (``\\\\``, ``\\"``, ``\\xNN`` for control characters); a lone
  ``;`` separates commands, so ``\\;``.
* ``Environment=`` and list directives (``ReadWritePaths=``): the same quoting, ``$`` is literal.
* ``Description=`` is free text: no quoting, so control characters become visible ``\\xNN``
  text; comments too, with backslashes doubled (in an environment file a backslash in a
  comment escapes the next character, even the line break).
* single-path directives (``WorkingDirectory=``, ``EnvironmentFile=``) are not unquoted:
  absolute, normalized, printable paths only, ``%`` doubled.
* environment files: ``NAME="value"`` with ``\\``, ``"``, `````` and ``$`` backslash-escaped
  (the only escapes systemd's parser honours inside double quotes); no line breaks.
* commands for a remote shell (SSH): ``ssh_command(argv)`` is ``shlex.join``: one argv list,
  every word quoted for a POSIX shell. Never build a command line by formatting strings.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from collections.abc import Sequence

from fleet.errors import RenderError

_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./\-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNPRINTABLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def _unprintable(c: str) -> bool:
    return unicodedata.category(c) in _UNPRINTABLE


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise RenderError("a value for a unit file contains NUL, which systemd cannot represent")
    return value


def _c_escape(value: str) -> str:
    out = []
    for c in value:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif _unprintable(c):
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogatepass")))
        else:
            out.append(c)
    return "".join(out)


def systemd_word(value: str, dollar: bool = False) -> str:
    """One word of a directive that systemd splits into words (unquoted, C-unescaped).

    ``dollar``: the directive expands ``$VAR`` (``ExecStart=``), so ``$`` is doubled.
    """
    escaped = _no_nul(value).replace("%", "%%")
    if dollar:
        escaped = escaped.replace("$", "$$")
    if escaped == ";":
        return "\\;"
    if _PLAIN.fullmatch(escaped):
        return escaped
    return '"' + _c_escape(escaped) + '"'


def systemd_arg(value: str) -> str:
    """One argument of ``ExecStart=``: specifiers, variables and quoting escaped."""
    return systemd_word(value, dollar=True)


def systemd_assignment(name: str, value: str) -> str:
    """One ``NAME=value`` word of ``Environment=``."""
    if not _ENV_NAME.fullmatch(name):
        raise RenderError(f"not an environment variable name: {name!r}")
    return systemd_word(f"{name}={value}")


def systemd_text(value: object) -> str:
    """Free text in ``Description=``: one line, specifiers escaped, otherwise shown as written.

    The directive is not unquoted, so a backslash is literal, except at the very end of a line
    (it continues the line): templates put text here only mid-line (``Description=vLLM X (...)``).
    """
    text = str(value)
    out = []
    for c in text:
        if _unprintable(c):
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogatepass")))
        else:
            out.append(c)
    return "".join(out).replace("%", "%%")


def systemd_path(value: str) -> str:
    """An absolute path in a directive that takes one path as written (not unquoted)."""
    check_host_path(value)
    return value.replace("%", "%%")


def check_host_path(value: str) -> str:
    """A path on a host (fleet's own layout) that lands in a unit: absolute, normalized, plain."""
    parts = value.split("/")
    if (
        not value.startswith("/")
        or any(p in (".", "..") for p in parts)
        or "//" in value
        or any(_unprintable(c) or c.isspace() or c in "\\\"'$;" for c in value)
    ):
        raise RenderError(f"not an absolute, normalized path without spaces, quotes, '$' or ';': {value!r}")
    return value


def env_file_value(value: str) -> str:
    """A value in a systemd ``EnvironmentFile=``: double-quoted, one line."""
    if any(_unprintable(c) for c in value):
        raise RenderError("a value for an environment file must be one line of printable characters")
    return '"' + re.sub(r'([\\"`$])', r"\\\1", value) + '"'


def comment_text(value: object) -> str:
    """Text in a comment of a unit or an environment file: one line, backslashes doubled.

    In an environment file a backslash in a comment escapes the next character, even a line
    break, so the comment would swallow the next line; doubled, each escapes its twin.
    """
    return systemd_text(str(value).replace("\\", "\\\\"))


def ssh_command(argv: Sequence[str]) -> str:
    """The one way to turn an argv list into a command line for a remote POSIX shell (SSH)."""
    if not argv:
        raise ValueError("an empty command")
    for word in argv:
        if "\0" in word:
            raise RenderError("a command argument contains NUL")
    return shlex.join(argv)


_HAPROXY_WORD = re.compile(r"[A-Za-z0-9._@+/:\[\]-]+")


def haproxy_word(value: str) -> str:
    """One word of an HAProxy configuration line, written as is: names, addresses and paths that
    the inventory validated to plain characters. Anything else (a space, ``#``, a quote, ``$``, a
    backslash, a line break) would change the line's meaning, so it is refused here too."""
    if not _HAPROXY_WORD.fullmatch(value):
        raise RenderError(f"{value!r} cannot be written into an HAProxy configuration as one word")
    return value

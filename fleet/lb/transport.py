"""Reaching HAProxy's admin socket: on this machine (a unix socket), or on a balancer host over SSH.

* ``LocalSocket``: Python's ``socket`` (``AF_UNIX``), one connection per command line, as the
  management guide's non-interactive mode has it: the line, then a read to end of file, all
  within ``timeout_s``.
* ``SshSocket``: on the balancer host, ``sudo -n socat -t T STDIO UNIX-CONNECT:<socket>`` under
  coreutils ``timeout``, the command line on stdin. ``socat`` is what HAProxy's management guide
  uses for every example ("an external utility such as socat is required"); Debian packages it
  and ``fleet deploy`` installs it with ``haproxy`` on balancer hosts (Debian's ``haproxy``
  package brings no client of its own). ``sudo``: Debian's socket is ``mode 660`` for group
  ``haproxy``, which the SSH user is not in. One SSH connection per balancer host, opened
  lazily, opened again once when it broke (strict host keys, ``fleet.facts.runner.connect``);
  every command has its deadline also when the host stops answering (``fleet.facts.sshlink``).

Failures are sorted for the caller: ``BalancerDown`` (nothing answers: no socket, refused, the
host unreachable, no answer in time: exit 1, "the balancer is down") and ``BalancerMisconfigured``
(something answers but fleet cannot use it: permission denied, not a socket, no ``socat``, no
passwordless sudo: exit 2). Both name the balancer and the way out.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Protocol

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts import sshlink
from fleet.facts.runner import SshTarget, connect


class BalancerError(FleetError):
    """The balancer could not be asked (``BalancerDown``) or cannot be used (``BalancerMisconfigured``)."""


class BalancerDown(BalancerError):
    """Nothing answers at the admin socket: HAProxy is not running there, or its host is unreachable."""


class BalancerMisconfigured(BalancerError):
    """Something answers, but fleet cannot use it (permissions, a missing tool, not HAProxy's socket)."""


class Transport(Protocol):
    """Sends one command line to an admin socket and returns everything HAProxy answered."""

    name: str  #: for messages: "haproxy on this machine (/run/haproxy/admin.sock)"

    def send(self, line: str) -> str: ...

    def close(self) -> None: ...


def _line(line: str) -> bytes:
    if "\n" in line or "\r" in line:
        raise ValueError("one command line at a time")
    return line.encode() + b"\n"


class LocalSocket:
    """HAProxy's admin socket on this machine."""

    def __init__(self, path: str, timeout_s: float, name: str = "") -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.name = name or f"haproxy on this machine ({path})"

    def send(self, line: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except FileNotFoundError:
                raise BalancerDown(f"{self.name}: no socket at {self.path}: is haproxy running?") from None
            except ConnectionRefusedError:
                raise BalancerDown(f"{self.name}: connection refused at {self.path}: haproxy is not running") from None
            except PermissionError:
                raise BalancerMisconfigured(
                    f"{self.name}: permission denied on {self.path}: run fleet as a user that may write the socket "
                    "(its `stats socket ... mode/user/group`)"
                ) from None
            except OSError as exc:
                raise BalancerMisconfigured(f"{self.name}: {self.path}: {exc.strerror or exc}") from None
            sock.sendall(_line(line))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
        except TimeoutError:
            raise BalancerDown(f"{self.name}: no complete answer within {self.timeout_s:g}s") from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise BalancerDown(f"{self.name}: the connection broke ({exc})") from None
        finally:
            sock.close()

    def close(self) -> None:
        pass


#: socat's own exit statuses are 1 for every error; its message says which.
_DOWN_WORDS = ("No such file or directory", "Connection refused", "Connection reset")
_MISCONFIGURED_WORDS = ("Permission denied", "Not a socket", "Protocol wrong type", "a password is required",
                        "terminal is required", "sudo:")  # fmt: skip


class SshSocket:
    """HAProxy's admin socket on a balancer host, through ``socat`` over SSH (see the module docstring)."""

    def __init__(self, target: SshTarget, path: str, timeout_s: float, name: str = "") -> None:
        self.target = target
        self.path = path
        self.timeout_s = timeout_s
        self.name = name or f"haproxy on host {target.name} ({path})"
        self._link: sshlink.Link | None = None
        self._lock = threading.Lock()

    def command(self) -> str:
        t = f"{self.timeout_s:g}"
        return ssh_command(
            ["sudo", "-n", "timeout", "-k", "2", t, "socat", "-t", t, "STDIO", f"UNIX-CONNECT:{self.path}"]
        )

    def _connected(self, fresh: bool) -> sshlink.Link:
        if self._link is not None and (fresh or not self._link.active):
            self._link.close()
            self._link = None
        if self._link is None:
            self._link = sshlink.Link(self.target.name, connect(self.target, timeout=min(10.0, self.timeout_s + 5)))
        return self._link

    def send(self, line: str) -> str:
        payload = _line(line)
        last: Exception | None = None
        with self._lock:
            for attempt in range(2):
                try:
                    link = self._connected(fresh=attempt > 0)
                    rc, stdout, stderr = link.run(
                        self.command(), self.timeout_s + 10, stdin=payload, label=f"socat to {self.path}"
                    )
                    break
                except sshlink.HostKeyError as exc:
                    raise BalancerMisconfigured(f"{self.name}: {exc.reason}") from None
                except sshlink.ConnectionLost as exc:
                    last = exc  # reads only: sending again is harmless, and a `set` of the same state too
                except sshlink.SshError as exc:  # unreachable (silent, refused), a login refused, no answer in time
                    raise BalancerDown(f"{self.name}: {exc.reason}") from None
            else:
                raise BalancerDown(f"{self.name}: SSH to {self.target.hostname}:{self.target.port} failed: "
                                   f"{last.reason if isinstance(last, sshlink.SshError) else 'no answer'}")  # fmt: skip
        if rc == 0:
            return stdout
        tail = (stderr or stdout).strip()[-300:]
        if rc in (124, 137):
            raise BalancerDown(f"{self.name}: no complete answer within {self.timeout_s:g}s")
        if rc == 127:
            raise BalancerMisconfigured(
                f"{self.name}: socat is not installed on host {self.target.name} ({tail}); `fleet deploy` installs "
                "it with haproxy, or: apt-get install socat"
            )
        if any(w in tail for w in _MISCONFIGURED_WORDS):
            raise BalancerMisconfigured(f"{self.name}: {tail} (the SSH user needs passwordless sudo for socat)")
        if any(w in tail for w in _DOWN_WORDS):
            raise BalancerDown(f"{self.name}: {tail}: is haproxy running on host {self.target.name}?")
        raise BalancerMisconfigured(f"{self.name}: socat exited {rc}: {tail}")

    def close(self) -> None:
        link = self._link  # not under the lock: closing ends a command in flight at once
        if link is not None:
            link.close()

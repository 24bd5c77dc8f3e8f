"""SSH connections whose every wait has a deadline, also when the host stops answering.

What paramiko does (read in paramiko 4.0's source, ``transport.py`` and ``channel.py``) and why
that is not enough on its own:

* ``Channel.exec_command`` waits for the server's answer to the exec request with
  ``Event.wait()`` and no timeout (``Channel._wait_for_event``); ``Channel.recv_exit_status``
  waits on ``status_event`` the same way. ``exec_command(timeout=)`` and ``Channel.settimeout``
  bound each *read* only: a command that prints nothing for a long time (``systemctl stop``
  while vLLM drains) cannot tell a silent host from a slow command by its reads.
* ``Transport.set_keepalive`` sends ``keepalive@lag.net`` with want-reply *false*
  (``set_keepalive`` → ``global_request(..., wait=False)``): it keeps a NAT mapping open but never
  notices a host that stopped answering. TCP does not notice either: a frozen host's kernel
  acknowledges every segment, and a partition ends a connection only after ``tcp_retries2``
  (about 15 minutes on Linux).
* ``Transport.close()`` ends every one of those waits: ``stop_thread`` clears ``active`` (the
  loops in ``open_channel``, ``global_request`` and ``_send_user_message`` check it) and each
  channel's ``_unlink`` sets its events and closes its buffers (``recv`` returns EOF).

So a connection made here carries:

* a **heartbeat** while a command is in flight: ``keepalive@openssh.com`` with want-reply every
  ``heartbeat_s`` seconds, what OpenSSH's ``ServerAliveInterval`` sends (``clientloop.c:
  server_alive_check``); a server answers a request it does not know with
  SSH_MSG_REQUEST_FAILURE (RFC 4254 section 4), so every answer is proof of life, and the time
  of the last one is kept;
* a **watchdog** (a thread per connection, while a command is in flight) that closes the
  transport of a connection whose heartbeat went unanswered for ``silent_s`` seconds (OpenSSH's
  ``ServerAliveCountMax`` × interval), and of a command stuck inside paramiko past its
  deadline; the command then fails with ``Unreachable`` (or ``CommandTimeout``) instead of
  waiting for the partition to end;
* **a deadline per command**, checked by the command's own read loop (a channel timeout of
  ``POLL_S`` on every read) against ``time.monotonic()``;
* **a connect deadline**: the TCP connect, the banner, the key exchange and authentication
  together, enforced by shutting the socket down when it passes.

Every failure is one ``SshError`` whose text says what happened in one line (never paramiko's
traceback: that goes to fleet's log file, ``fleet.logs``). A changed host key shows the SHA256
fingerprints, expected and offered, as OpenSSH does, and the ``ssh-keygen -R HOST -f FILE`` for
the known_hosts file fleet actually reads.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import paramiko

from fleet.errors import FleetError


@dataclass(frozen=True)
class SshTarget:
    """How to reach one host, from pyinfra host data (``ssh_*`` keys)."""

    name: str
    hostname: str
    port: int = 22
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    strict: bool = True

    @classmethod
    def from_data(cls, name: str, data: Mapping[str, Any]) -> SshTarget:
        """Read and check the SSH settings; a bad one is a ``FleetError`` before any host is touched."""
        strict = str(data.get("ssh_strict_host_key_checking", "yes")).lower() not in ("no", "off", "false")
        port = data.get("ssh_port") or 22
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise FleetError(f"host {name}: ssh_port={port!r}: an integer from 1 to 65535")
        texts: dict[str, str | None] = {}
        for key in ("ssh_hostname", "ssh_user", "ssh_key", "ssh_known_hosts_file"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise FleetError(f"host {name}: {key}={value!r}: a non-empty string")
            texts[key] = value
        return cls(
            name=name,
            hostname=texts["ssh_hostname"] or name,
            port=port,
            user=texts["ssh_user"],
            key=texts["ssh_key"],
            known_hosts=texts["ssh_known_hosts_file"],
            strict=strict,
        )


#: Seconds between heartbeats while a command is in flight.
HEARTBEAT_S = 3.0
#: Seconds without an answer to a heartbeat after which the host is unreachable (4 heartbeats).
SILENT_S = 12.0
#: Seconds for TCP connect, banner, key exchange and authentication together.
CONNECT_TIMEOUT_S = 10.0
#: How often a waiting command and the watchdog look at their clocks.
POLL_S = 0.1
#: Longest command text shown in an error; a longer one is named by its label instead.
SHOWN_COMMAND = 100


class SshError(FleetError):
    """An SSH failure on one host, in one line: ``host NAME: SSH failed: REASON``."""

    def __init__(self, host: str, reason: str, since: float | None = None) -> None:
        self.host = host
        self.reason = reason
        #: wall-clock time the host was last heard from (``Unreachable`` only)
        self.since = since
        super().__init__(f"host {host}: SSH failed: {reason}")


class Unreachable(SshError):
    """The host does not answer: no connection could be made, or an open one went silent."""


class ConnectionLost(SshError):
    """The connection closed under a command (the host rebooted, sshd restarted): a new
    connection may work, and the command may or may not have run."""


class HostKeyError(SshError):
    """The host's key is not the one known_hosts holds for it (changed or unknown): refused."""


class AuthError(SshError):
    """The host answered but refused the login (user, key)."""


class CommandTimeout(SshError):
    """The host answers, but the command did not finish within its deadline."""


def short(command: str, label: str = "") -> str:
    """How a command is named in an error: its label, or its text when that is short."""
    if label:
        return label
    text = " ".join(command.split())
    return f"`{text}`" if len(text) <= SHOWN_COMMAND else f"`{text[: SHOWN_COMMAND - 3]}...`"


# ---- connecting ------------------------------------------------------------------------------------


def known_hosts_of(target: SshTarget) -> str:
    """The known_hosts file fleet checks ``target``'s key against."""
    return os.path.expanduser(target.known_hosts or "~/.ssh/known_hosts")


def known_hosts_entry(hostname: str, port: int) -> str:
    """The name OpenSSH (and paramiko) look a host up by: ``addr``, or ``[addr]:port`` off port 22."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def key_words(key: paramiko.PKey) -> str:
    """``ED25519 SHA256:...`` (the type and fingerprint OpenSSH shows)."""
    return f"{key.algorithm_name} {key.fingerprint}"


def changed_key_reason(target: SshTarget, expected: paramiko.PKey, offered: paramiko.PKey) -> str:
    known = known_hosts_of(target)
    entry = known_hosts_entry(target.hostname, target.port)
    keyscan = ["ssh-keyscan", "-t", offered.get_name(), *(["-p", str(target.port)] if target.port != 22 else [])]
    return (
        f"the host key of {entry} has changed: {known} holds {key_words(expected)}, the host offered "
        f"{key_words(offered)}; refused (the host was reinstalled, or someone is in the middle). Check the "
        "offered fingerprint out of band (on the host's console: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub); "
        f"if it matches, remove the old key with `ssh-keygen -R {shlex.quote(entry)} -f {shlex.quote(known)}` "
        f"and add the new one (`{shlex.join([*keyscan, target.hostname])} >> {shlex.quote(known)}`, then compare "
        f"`ssh-keygen -lf {shlex.quote(known)}` with what you checked)"
    )


class _UnknownKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("unknown host key")
        self.key = key


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    """paramiko's ``RejectPolicy``, keeping the offered key for the message."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownKey(key)


def _tcp_reason(addr: str, exc: OSError, timeout: float) -> str:
    if isinstance(exc, socket.gaierror):
        return f"unreachable: cannot resolve {addr.rsplit(':', 1)[0]}: {exc.strerror or exc}"
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"unreachable: {addr} did not answer the TCP connect within {timeout:g}s (down, or the network drops it)"
    if isinstance(exc, ConnectionRefusedError):
        return f"unreachable: {addr} refused the connection (no sshd listening)"
    return f"unreachable: {addr}: {exc.strerror or exc}"


def connect(
    target: SshTarget, timeout: float = CONNECT_TIMEOUT_S, sock: socket.socket | None = None
) -> paramiko.SSHClient:
    """A logged-in client for ``target`` within ``timeout`` seconds (over ``sock`` when its TCP
    connection is already made; it is closed on failure), host key checked strictly (unless the
    inventory says ``ssh_strict_host_key_checking=no``); else ``SshError``."""
    deadline = time.monotonic() + timeout
    addr = f"{target.hostname}:{target.port}"
    key = os.path.expanduser(target.key) if target.key else None
    if key is not None and not os.access(key, os.R_OK):
        if sock is not None:
            sock.close()
        raise AuthError(target.name, f"ssh_key {key} cannot be read here")
    if sock is None:
        try:
            sock = socket.create_connection((target.hostname, target.port), timeout=timeout)
        except OSError as exc:
            raise Unreachable(target.name, _tcp_reason(addr, exc, timeout), since=None) from None
    client = paramiko.SSHClient()
    known = known_hosts_of(target)
    if os.path.isfile(known):
        client.load_host_keys(known)
    client.set_missing_host_key_policy(_RefuseUnknown() if target.strict else paramiko.WarningPolicy())
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    left = max(0.1, deadline - time.monotonic())
    timer = threading.Timer(left, expire)
    timer.daemon = True
    timer.start()
    try:
        client.connect(
            target.hostname, port=target.port, username=target.user, key_filename=key, allow_agent=key is None,
            look_for_keys=key is None, timeout=left, banner_timeout=left, auth_timeout=left, sock=sock,
        )  # fmt: skip
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise HostKeyError(target.name, changed_key_reason(target, exc.expected_key, exc.key)) from None
    except _UnknownKey as exc:
        client.close()
        entry = known_hosts_entry(target.hostname, target.port)
        raise HostKeyError(
            target.name,
            f"{entry} is not in {known} (it offered {key_words(exc.key)}); check that fingerprint out of band, "
            f"then add the key: `ssh-keyscan -p {target.port} {target.hostname} >> {shlex.quote(known)}`",
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        who = target.user or "the default user"
        with_key = f"key {key}" if key else "the agent's and ~/.ssh keys"
        raise AuthError(target.name, f"{addr} refused the login as {who} with {with_key}: {exc}") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        sock.close()
        if expired.is_set() or "banner" in str(exc) or isinstance(exc, EOFError | socket.timeout):
            raise Unreachable(
                target.name,
                f"unreachable: {addr} took the TCP connection but the SSH handshake did not finish within "
                f"{timeout:g}s (sshd does not answer: host frozen or overloaded?)",
            ) from None
        why = str(exc) or type(exc).__name__
        raise Unreachable(target.name, f"unreachable: {addr}: SSH handshake failed: {why}") from None
    finally:
        timer.cancel()
    return client


# ---- commands with deadlines ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    """One command in flight: its deadline, for the watchdog's backstop."""

    deadline: float
    timeout: float
    expired: bool = False


@dataclass(eq=False)
class Link:
    """One open SSH connection whose commands end in bounded time (see the module docstring).

    Safe to use from several threads at once: each command has its own channel.
    """

    name: str
    client: paramiko.SSHClient
    silent_s: float = SILENT_S
    heartbeat_s: float = HEARTBEAT_S
    #: ``time.monotonic()`` and wall-clock time of the host's last answer
    answered: float = field(default_factory=time.monotonic)
    answered_wall: float = field(default_factory=time.time)
    #: why the watchdog closed the connection; empty while it is fine
    dead: str = ""
    _jobs: set[_Job] = field(default_factory=set)
    #: made when the link is (not at import): under gevent (``fleet deploy``) a patched lock
    _lock: threading.Lock = field(default_factory=lambda: threading.Lock())
    _heart: bool = False  #: a heartbeat thread runs
    _watching: bool = False  #: a watchdog thread runs

    @property
    def transport(self) -> paramiko.Transport | None:
        return self.client.get_transport()

    @property
    def active(self) -> bool:
        t = self.transport
        return not self.dead and t is not None and t.is_active()

    def close(self) -> None:
        """Close the connection (from any thread, without waiting for a command in flight)."""
        self.client.close()

    # -- the heartbeat and the watchdog's view ---------------------------------------------------------

    def _heard(self) -> None:
        self.answered, self.answered_wall = time.monotonic(), time.time()

    def hold(self, timeout: float) -> object:
        """Watch the connection for ``timeout`` seconds (``math.inf``: until ``release``) while
        another library runs commands over it (pyinfra's operations): the heartbeat runs, and
        the watchdog closes the client once the host has not answered for ``silent_s``."""
        return self._begin(timeout)

    def release(self, job: object) -> None:
        """Stop watching for ``hold``'s job."""
        if isinstance(job, _Job):
            self._end(job)

    def _begin(self, timeout: float) -> _Job:
        job = _Job(time.monotonic() + timeout, timeout)
        beat = watch = False
        with self._lock:
            if not self._jobs:
                self._heard()  # silence counts from when someone waits on the host
            self._jobs.add(job)
            if not self._heart:
                self._heart = beat = True
            if not self._watching:
                self._watching = watch = True
        # started outside the lock: under gevent, starting a thread yields to it
        if beat:
            threading.Thread(target=self._beat, name=f"ssh-heartbeat-{self.name}", daemon=True).start()
        if watch:
            threading.Thread(target=self._watchdog, name=f"ssh-watchdog-{self.name}", daemon=True).start()
        return job

    def _end(self, job: _Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _beat(self) -> None:
        while True:
            with self._lock:
                t = self.transport
                if not self._jobs or self.dead or t is None or not t.is_active():
                    self._heart = False
                    return
            try:
                t.global_request("keepalive@openssh.com", wait=True)  # returns on an answer, or once closed
            except Exception:  # the connection broke while sending: whoever waits on it finds out
                with self._lock:
                    self._heart = False
                return
            if t.is_active():
                self._heard()
            time.sleep(self.heartbeat_s)

    def _watchdog(self) -> None:
        """While a command is in flight: every ``POLL_S``, ``_watch``."""
        while True:
            time.sleep(POLL_S)
            with self._lock:
                if not self._jobs or self.dead:
                    self._watching = False
                    return
            if not self._watch(time.monotonic()):
                with self._lock:
                    self._watching = False
                return

    def _watch(self, now: float) -> bool:
        """The watchdog's look at this link; False once there is nothing left to watch."""
        with self._lock:
            jobs = list(self._jobs)
        if not jobs or self.dead:
            return False
        silent = now - self.answered
        if silent > self.silent_s:
            self._kill(f"unreachable: no answer to SSH keepalives for {silent:.0f}s (host frozen, down or cut off)")
            return False
        stuck = [j for j in jobs if now > j.deadline + 2 * self.heartbeat_s]
        if stuck:  # the command's own loop did not end it: it is stuck inside paramiko
            for j in stuck:
                j.expired = True
            self._kill("a command stayed blocked past its deadline; the connection was closed")
            return False
        return True

    def _kill(self, why: str) -> None:
        self.dead = why
        with contextlib.suppress(Exception):  # ends every wait on it (module docstring)
            self.client.close()

    def _unreachable(self, what: str) -> Unreachable:
        return Unreachable(self.name, f"{self.dead} during {what}", since=self.answered_wall)

    # -- running a command ----------------------------------------------------------------------------------

    def run(self, command: str, timeout: float, stdin: bytes = b"", *, label: str = "") -> tuple[int, str, str]:
        """Run ``command``: (exit status, stdout, stderr), within ``timeout`` seconds, or ``SshError``.

        ``label`` names the command in errors (default: its text, shortened)."""
        what = short(command, label)
        if self.dead:
            raise self._unreachable(what)
        job = self._begin(timeout)
        chan: paramiko.Channel | None = None
        try:
            t = self.transport
            if t is None or not t.is_active():
                raise ConnectionLost(self.name, "the connection closed")
            chan = t.open_session(timeout=min(timeout, self.silent_s + self.heartbeat_s))
            chan.exec_command(command)
            if stdin:
                chan.settimeout(max(POLL_S, job.deadline - time.monotonic()))
                chan.sendall(stdin)
            chan.shutdown_write()
            chan.settimeout(POLL_S)
            return self._collect(chan, job, what)
        except SshError:
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if self.dead:
                raise self._unreachable(what) from None
            if job.expired:
                raise CommandTimeout(self.name, f"{what} did not finish within {timeout:g}s") from None
            why = str(exc) or "the connection closed"
            raise ConnectionLost(self.name, f"{why} (during {what})") from None
        finally:
            self._end(job)
            if chan is not None:
                with contextlib.suppress(Exception):
                    chan.close()

    def _collect(self, chan: paramiko.Channel, job: _Job, what: str) -> tuple[int, str, str]:
        out, err = bytearray(), bytearray()
        eof = False
        while True:
            got = False
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                got = True
            if not eof:
                try:
                    data = chan.recv(65536)  # waits up to POLL_S (the channel's timeout)
                except TimeoutError:
                    data = None
                if data:
                    out += data
                    got = True
                eof = data == b""
            if got:
                self._heard()  # output is an answer too
            if eof and chan.exit_status_ready():
                break
            if eof and not got:
                chan.status_event.wait(POLL_S)
            if self.dead:
                raise self._unreachable(what)
            if time.monotonic() > job.deadline:
                job.expired = True
                raise CommandTimeout(self.name, f"{what} did not finish within {job.timeout:g}s")
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        if self.dead:
            raise self._unreachable(what)
        t = self.transport
        if not chan.status_event.is_set() or (chan.exit_status == -1 and (t is None or not t.is_active())):
            # paramiko: "If no exit status is provided by the server, -1 is returned". With the
            # connection gone too, the host went down under the command: not its failure.
            raise ConnectionLost(self.name, f"the connection closed before the exit status of {what} came")
        self._heard()
        return chan.exit_status, out.decode(errors="replace"), err.decode(errors="replace")


def run_once(
    target: SshTarget,
    command: str,
    timeout: float,
    *,
    sock: socket.socket | None = None,
    silent_s: float = SILENT_S,
    heartbeat_s: float = HEARTBEAT_S,
    label: str = "",
) -> tuple[int, str, str]:
    """Connect (or log in over ``sock``), run one command with its deadline, close. ``label``
    names the command in errors (``Link.run``)."""
    link = Link(target.name, connect(target, min(timeout, CONNECT_TIMEOUT_S), sock), silent_s, heartbeat_s)
    try:
        return link.run(command, timeout, label=label)
    finally:
        link.close()


def describe(exc: BaseException, target: SshTarget, timeout: float = CONNECT_TIMEOUT_S) -> str:
    """One line for an SSH failure that did not come from here (e.g. through pyinfra's connector)."""
    if isinstance(exc, SshError):
        return exc.reason
    addr = f"{target.hostname}:{target.port}"
    if isinstance(exc, paramiko.BadHostKeyException):
        return changed_key_reason(target, exc.expected_key, exc.key)
    if isinstance(exc, paramiko.AuthenticationException):
        return f"{addr} refused the login as {target.user or 'the default user'}: {exc}"
    if isinstance(exc, OSError) and not isinstance(exc, EOFError):
        return _tcp_reason(addr, exc, timeout)
    if isinstance(exc, EOFError) or "banner" in str(exc) or "No existing session" in str(exc):
        return (
            f"unreachable: {addr} took the TCP connection but the SSH handshake did not finish "
            "(sshd does not answer: host frozen or overloaded?)"
        )
    return f"unreachable: {addr}: {exc or type(exc).__name__}"

"""Run a pyinfra fact on many hosts in parallel: one SSH connection and one command per host.

Uses paramiko directly (pyinfra's own transport) from a thread pool rather than a pyinfra
``State``: a fact is one command, and this avoids gevent monkey-patching the whole process,
the single-use ``State``/``Inventory`` and the SSH clients ``disconnect_all`` leaves open
(pyinfra 3.10, ``pyinfra.api``). The fact class is a plain pyinfra fact (``command()`` and
``process()``), so the pyinfra CLI and deploys can run the same fact.

Host keys are checked strictly against the host's ``ssh_known_hosts_file`` (or
``~/.ssh/known_hosts``): an unknown or changed key is refused, never added. Connections and
commands have deadlines that hold when a host stops answering (``fleet.facts.sshlink``); a host
that cannot be asked is a ``HostUnreachable`` with the reason in one line.

With ``connect_timeout`` (the read-only probes of ``fleet plan``), every host's SSH port is
connected to at once before any SSH session starts (:func:`open_connections`: non-blocking
sockets and one selector, no thread per host), so hosts that do not answer cost one bounded
attempt in parallel, ``connect_timeout`` seconds for all of them, instead of a pool slot each
for the whole timeout (1,000 silent hosts with a pool of 64: 16 timeouts one after another). The
pool then runs SSH on the connected sockets (paramiko's ``SSHClient.connect(sock=...)``).

**Example:**

.. code:: python

    results = run_fact_on_hosts(inventory, NvmlProbe)
    for host, result in results.items():
        if isinstance(result, HostUnreachable): ...
"""

from __future__ import annotations

import errno
import os
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, TypeVar

import paramiko
from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.facts import sshlink
from fleet.facts.sshlink import CONNECT_TIMEOUT_S, SshError
from fleet.facts.sshlink import SshTarget as SshTarget

T = TypeVar("T")
DEFAULT_TIMEOUT = 60.0
MAX_PARALLEL = 64
#: File descriptors kept free for everything else while :func:`open_connections` holds sockets.
_FD_MARGIN = 128


@dataclass(frozen=True)
class HostUnreachable:
    """A host the fact could not be run on (or whose output could not be read), and why."""

    host: str
    reason: str
    #: the host could not be asked at all (SSH), as opposed to a command's failure (not compared:
    #: the reason says it too)
    ssh_failed: bool = field(default=False, compare=False)


@dataclass
class FactRun:
    """Timing of one run, for progress displays and benchmarks."""

    seconds: dict[str, float] = field(default_factory=dict)


Progress = Callable[[str, object], None]


def targets_from_inventory(inventory: Any, names: Iterable[str] | None = None) -> list[SshTarget]:
    """SSH targets of a pyinfra ``Inventory`` (optionally only ``names``)."""
    wanted = set(names) if names is not None else None
    out = []
    for host in inventory:
        if wanted is not None and host.name not in wanted:
            continue
        out.append(SshTarget.from_data(host.name, host.data.dict()))
    return out


def connect(
    target: SshTarget, timeout: float = CONNECT_TIMEOUT_S, sock: socket.socket | None = None
) -> paramiko.SSHClient:
    """A logged-in client within ``timeout`` seconds (over ``sock`` when it is already connected),
    or ``SshError`` (``fleet.facts.sshlink.connect``)."""
    return sshlink.connect(target, timeout, sock)


def run_command(
    target: SshTarget, command: str, timeout: float = DEFAULT_TIMEOUT, sock: socket.socket | None = None
) -> tuple[int, str, str]:
    """Connect (or log in over ``sock``), run one command, close: (exit status, stdout, stderr),
    or ``SshError``. The command's stdin is closed at once (as ``ssh -n``), and it has a deadline
    of ``timeout`` seconds that holds even when the host stops answering mid-command
    (``fleet.facts.sshlink``: a heartbeat and a watchdog)."""
    return sshlink.run_once(target, command, timeout, sock=sock)


def fact_answer(host: str, fact: FactBase[T], rc: int, out: str, err: str) -> T | HostUnreachable:
    """A fact's value from its command's exit status and output, or why there is none."""
    if rc != 0:
        return HostUnreachable(host, f"fact command exited {rc}: {err.strip()[-300:]}")
    try:
        return fact.process(out.splitlines())
    except FleetError as exc:
        return HostUnreachable(host, f"unreadable answer: {exc}")


def _one(
    target: SshTarget, fact: FactBase[T], command: str, timeout: float, sock: socket.socket | None = None
) -> T | HostUnreachable:
    try:
        rc, out, err = run_command(target, command, timeout, sock)
    except SshError as exc:
        return HostUnreachable(target.name, exc.reason, ssh_failed=True)
    return fact_answer(target.name, fact, rc, out, err)


def _resolve(target: SshTarget) -> list[tuple[int, Any]] | str:
    """The (family, address) pairs of ``target``'s SSH port, or why it does not resolve."""
    try:
        infos = socket.getaddrinfo(target.hostname, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"cannot resolve {target.hostname}: {exc}"
    return [(family, address) for family, _type, _proto, _name, address in infos] or f"{target.hostname}: no address"


def _fd_budget(wanted: int) -> int:
    """How many sockets may be open at once: the soft RLIMIT_NOFILE, raised towards the hard one
    when ``wanted`` needs it, less what is open now and a margin."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    need = in_use + wanted + _FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(MAX_PARALLEL, soft - in_use - _FD_MARGIN)


def _why(code: int) -> str:
    return os.strerror(code) if code else "closed"


def open_connections(
    targets: Sequence[SshTarget], timeout: float, parallel: int = MAX_PARALLEL
) -> dict[str, socket.socket | str]:
    """Connect to every target's SSH port at once: ``{host: connected socket | why not}``.

    Every address a host name resolves to is tried at the same time (the first to answer wins);
    a host none of whose addresses answered within ``timeout`` seconds is "no answer". Names are
    resolved first, ``parallel`` at a time. When more sockets are wanted than file descriptors
    are allowed (after raising the soft limit as far as the hard one), hosts go in waves.
    """
    results: dict[str, socket.socket | str] = {}
    if not targets:
        return results
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(targets)))) as pool:
        answers = dict(zip([t.name for t in targets], pool.map(_resolve, targets), strict=True))
    addresses: dict[str, list[tuple[int, Any]]] = {}
    for name, answer in answers.items():
        if isinstance(answer, str):
            results[name] = answer
        else:
            addresses[name] = answer
    todo = [t for t in targets if t.name in addresses]
    budget = _fd_budget(sum(len(a) for a in addresses.values()))
    while todo:
        wave: list[SshTarget] = []
        used = 0
        while todo and (not wave or used + len(addresses[todo[0].name]) <= budget):
            used += len(addresses[todo[0].name])
            wave.append(todo.pop(0))
        results.update(_connect_wave(wave, addresses, timeout))
    return results


def _connect_wave(
    wave: Sequence[SshTarget], addresses: Mapping[str, list[tuple[int, Any]]], timeout: float
) -> dict[str, socket.socket | str]:
    results: dict[str, socket.socket | str] = {}
    errors: dict[str, str] = {}
    pending: dict[str, list[socket.socket]] = {}
    selector = selectors.DefaultSelector()
    try:
        for target in wave:
            for family, address in addresses[target.name]:
                try:
                    sock = socket.socket(family, socket.SOCK_STREAM)
                except OSError as exc:
                    errors[target.name] = str(exc)
                    continue
                sock.setblocking(False)
                code = sock.connect_ex(address)
                if code in (0, errno.EINPROGRESS):
                    pending.setdefault(target.name, []).append(sock)
                    selector.register(sock, selectors.EVENT_WRITE, (target.name, sock))
                else:
                    errors[target.name] = _why(code)
                    sock.close()
            if target.name not in pending:
                results[target.name] = errors.get(target.name, "no address")
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _mask in selector.select(left):
                name, sock = key.data
                selector.unregister(sock)
                pending[name].remove(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setblocking(True)
                    results[name] = sock
                    for other in pending.pop(name):  # the host answered on another address
                        selector.unregister(other)
                        other.close()
                    continue
                errors[name] = _why(code)
                sock.close()
                if not pending[name]:
                    del pending[name]
                    results[name] = errors[name]
        for name, socks in pending.items():  # silent: no answer in time
            for sock in socks:
                selector.unregister(sock)
                sock.close()
            results[name] = f"no answer within {timeout:g} s"
    except BaseException:
        for got in results.values():
            if isinstance(got, socket.socket):
                got.close()
        for socks in pending.values():
            for sock in socks:
                sock.close()
        raise
    finally:
        selector.close()
    return results


def run_fact_on_hosts(
    targets: Iterable[SshTarget],
    fact_cls: type[FactBase[T]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    parallel: int = MAX_PARALLEL,
    progress: Progress | None = None,
    timings: FactRun | None = None,
    args_for: Callable[[str], Mapping[str, Any]] | None = None,
    connect_timeout: float | None = None,
    **fact_args: Any,
) -> dict[str, T | HostUnreachable]:
    """Run ``fact_cls`` on every target at once; ``{host name: processed result | HostUnreachable}``.

    ``progress(host, result)`` is called as each host answers (from worker threads, and from
    this one for hosts that did not answer the connect); ``args_for(host)`` gives a host's own
    fact arguments (added to ``fact_args``). ``connect_timeout``: connect to every host's SSH
    port at once first, each bounded by that many seconds (see the module docstring); the
    connections are then held until the pool reaches them, so keep the fact quick.
    """
    fact = fact_cls()
    targets = list(targets)

    def command(name: str) -> str:
        return str(fact.command(**fact_args, **(dict(args_for(name)) if args_for else {})))

    results: dict[str, T | HostUnreachable] = {}
    if not targets:
        return results
    started = time.monotonic()

    def done(name: str, result: T | HostUnreachable) -> None:
        results[name] = result
        if timings is not None:
            timings.seconds[name] = time.monotonic() - started
        if progress is not None:
            progress(name, result)

    socks: dict[str, socket.socket | str] = {}
    if connect_timeout is not None:
        socks = open_connections(targets, connect_timeout, parallel)
        for t in targets:
            why = socks.get(t.name)
            if isinstance(why, str):
                done(t.name, HostUnreachable(t.name, f"cannot reach {t.hostname}:{t.port}: {why}", ssh_failed=True))
    reachable = [t for t in targets if t.name not in results]
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(reachable) or 1))) as pool:
            futures = {}
            for t in reachable:
                sock = socks.pop(t.name, None)
                futures[
                    pool.submit(
                        _one, t, fact, command(t.name), timeout, sock if isinstance(sock, socket.socket) else None
                    )
                ] = t
            for future in as_completed(futures):
                done(futures[future].name, future.result())
    finally:
        for left in socks.values():  # only when something above raised
            if isinstance(left, socket.socket):
                left.close()
    return {t.name: results[t.name] for t in targets}

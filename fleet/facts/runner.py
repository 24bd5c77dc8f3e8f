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

**Example:**

.. code:: python

    results = run_fact_on_hosts(inventory, NvmlProbe)
    for host, result in results.items():
        if isinstance(result, HostUnreachable): ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, TypeVar

import paramiko
from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.facts import sshlink
from fleet.facts.sshlink import CONNECT_TIMEOUT_S, SshError

T = TypeVar("T")
DEFAULT_TIMEOUT = 60.0
MAX_PARALLEL = 64


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


@dataclass(frozen=True)
class HostUnreachable:
    """A host the fact could not be run on (or whose output could not be read), and why."""

    host: str
    reason: str
    ssh_failed: bool = False  #: the host could not be asked at all (SSH), as opposed to a command's failure


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


def connect(target: SshTarget, timeout: float = CONNECT_TIMEOUT_S) -> paramiko.SSHClient:
    """A logged-in client within ``timeout`` seconds, or ``SshError`` (``fleet.facts.sshlink.connect``)."""
    return sshlink.connect(target, timeout)


def run_command(target: SshTarget, command: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, str, str]:
    """Connect, run one command, close: (exit status, stdout, stderr), or ``SshError``.

    The command has a deadline of ``timeout`` seconds that holds even when the host stops
    answering mid-command (``fleet.facts.sshlink``: a heartbeat and a watchdog)."""
    return sshlink.run_once(target, command, timeout)


def _one(target: SshTarget, fact: FactBase[T], command: str, timeout: float) -> T | HostUnreachable:
    try:
        rc, out, err = run_command(target, command, timeout)
    except SshError as exc:
        return HostUnreachable(target.name, exc.reason, ssh_failed=True)
    if rc != 0:
        return HostUnreachable(target.name, f"fact command exited {rc}: {err.strip()[-300:]}")
    try:
        return fact.process(out.splitlines())
    except FleetError as exc:
        return HostUnreachable(target.name, f"unreadable answer: {exc}")


def run_fact_on_hosts(
    targets: Iterable[SshTarget],
    fact_cls: type[FactBase[T]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    parallel: int = MAX_PARALLEL,
    progress: Progress | None = None,
    timings: FactRun | None = None,
    args_for: Callable[[str], Mapping[str, Any]] | None = None,
    **fact_args: Any,
) -> dict[str, T | HostUnreachable]:
    """Run ``fact_cls`` on every target at once; ``{host name: processed result | HostUnreachable}``.

    ``progress(host, result)`` is called as each host answers (from worker threads);
    ``args_for(host)`` gives a host's own fact arguments (added to ``fact_args``).
    """
    fact = fact_cls()
    targets = list(targets)

    def command(name: str) -> str:
        return str(fact.command(**fact_args, **(dict(args_for(name)) if args_for else {})))

    results: dict[str, T | HostUnreachable] = {}
    if not targets:
        return results
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(targets)))) as pool:
        started = time.monotonic()
        futures = {pool.submit(_one, t, fact, command(t.name), timeout): t for t in targets}
        for future in as_completed(futures):
            target = futures[future]
            result = future.result()
            results[target.name] = result
            if timings is not None:
                timings.seconds[target.name] = time.monotonic() - started
            if progress is not None:
                progress(target.name, result)
    return {t.name: results[t.name] for t in targets}

"""The rollout ``Executor`` over SSH (systemd, NVML, the release links) and HTTP (the gates).

One paramiko connection per host, opened on first use and reused for every step (strict host
keys, as ``fleet.facts.runner.connect`` checks them); a broken connection is opened again once
before the host is reported unreachable. Every command has a deadline that holds when the host
stops answering (``fleet.facts.sshlink``: a heartbeat, and a watchdog that closes a connection
silent for ``SILENT_S``); a host found unreachable is not asked again for ``RETRY_AFTER_S``, and
``InstanceFacts.unreachable_since`` says when it was last heard from, for the engine's
``unreachable_timeout_s``. Every remote command is an argv list joined with
``fleet.escape.ssh_command``; commands that change the host run under ``sudo -n``; an
error names a script by its name (``the fleet-switch script``), never by its text.

What each step reads or does on a host:

* unit state: ``systemctl show -p ActiveState,SubState,NRestarts,MainPID <unit>`` (systemd's
  own names, systemd.exec(5)/org.freedesktop.systemd1(5));
* the release an instance runs: its main process's interpreter, or for a stopped one the target
  of ``<root>/current`` (``fleet.facts.releases.running_release``: one definition, which
  ``fleet status`` and ``fleet deploy`` read too);
* GPU processes: the NVML probe (``fleet.facts.nvml``), run only while the unit is not active;
  a process on one of the instance's GPUs whose ``/proc/<pid>/cgroup`` names the instance's
  unit is ours (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker_TP*`` processes survive a
  SIGKILLed API server, vLLM ``vllm/v1/engine/utils.py``, issue vllm#55510), anything else is
  not fleet's to stop;
* ``flip_release``: the same two atomic ``ln -sfn`` + ``mv -T`` renames as the deploy (``previous``
  becomes what ``current`` named), under the host's switch lock and with temporary links named
  for the process (``fleet.operations.vllm.SWITCH_SH``: two instances of one host switching in
  one batch run one after the other), refused for a release whose marker file is missing;
* the gates: HTTP from this machine (``fleet.rollout.probe``), or, for hosts whose port cannot
  be reached from here, ``curl`` on the host over the same SSH connection (the API key goes to
  curl on stdin, never in argv);
* the load balancer in front of an instance (``fleet.lb.traffic``): its server's state and
  sessions with the facts, ``set server ... state`` as a step;
* hooks: on the control machine (argv, no shell), or with ``hooks.on: host`` on the instance's
  host over the same SSH connection as the SSH user: the argv joined by ``ssh_command`` and run
  under coreutils ``timeout`` (so a hook that runs over is ended on the host, not left behind
  when the channel gives up); a hook whose command was sent is never sent again after a broken
  connection (it may have run).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts import sshlink
from fleet.facts.hostfacts import parse_probe_output
from fleet.facts.nvml import CODE_CACHE, probe_command
from fleet.facts.releases import MARKER, main_exe_sh, release_of, running_release
from fleet.facts.runner import DEFAULT_TIMEOUT, HostUnreachable, SshTarget, fact_answer
from fleet.facts.systemctl_show import show_properties, shown_unit
from fleet.gpuwatch.state import parse_since_start, since_start_argv
from fleet.lb.runtime import AdminState
from fleet.lb.traffic import BalancerError, Traffic
from fleet.operations.files import write_command
from fleet.operations.vllm import DEFAULT_ROOT, SWITCH_SH
from fleet.render import revision as rev
from fleet.render.units import HostPaths
from fleet.rollout.batches import InstanceRef
from fleet.rollout.claims import (
    STATE_DIR,
    ClaimAnswer,
    ClaimRequest,
    HostClaims,
    claim_script,
    parse_answer,
    safe_word,
)
from fleet.rollout.executor import ExecutorError
from fleet.rollout.gates import GpuEvents, GpuEventSeen, Probe, UnitState
from fleet.rollout.observe import GpuProcess, InstanceFacts
from fleet.rollout.policy import HookPlace, RolloutPolicy
from fleet.rollout.probe import InstanceProber, _Reply
from fleet.rollout.stopping import STOP_PROPS, stop_outcome

SSH_TIMEOUT_S = 60.0
#: ``systemctl stop`` waits for the unit's TimeoutStopSec (vLLM's drain); this bounds the wait here.
STOP_TIMEOUT_S = 900.0
#: A unit state read this recently by ``facts`` is reused by ``probe`` (one SSH round trip a tick).
UNIT_FRESH_S = 1.0
UNIT_PROPS = ("ActiveState", "SubState", "NRestarts", "MainPID")
_UNIT_ARG = '"$1"'  #: the unit, as ``live``'s script is given it


@dataclass(frozen=True)
class InstanceSpec:
    """Where one instance lives: its host's unit, its GPUs, its URL and the model it serves."""

    ref: InstanceRef
    unit: str  #: e.g. ``fleet-vllm-0.service``
    url: str  #: e.g. ``http://10.0.0.5:8000`` (as reached from the control machine)
    port: int
    gpus: tuple[int, ...]
    model: str  #: the served model name the inventory gives it now
    unit_path: str = ""  #: the live unit file (default: ``/etc/systemd/system/<unit>``)
    env_path: str = ""  #: the live env file (default: ``/etc/fleet/<instance>.env``)
    adapters: tuple[str, ...] = ()  #: the LoRA adapters the inventory gives it now (``lora_adapters``)
    #: a node of an instance spanning hosts: every node's ref, leader first (its unit on each
    #: host has the instance's name); () for an instance on one host
    nodes: tuple[InstanceRef, ...] = ()

    @property
    def headless(self) -> bool:
        """A node other than its instance's leader: it serves no HTTP (``--headless``), so fleet
        asks it nothing over HTTP and it has no balancer seat."""
        return bool(self.nodes) and self.ref != self.nodes[0]

    @property
    def files(self) -> tuple[str, str]:
        return (
            self.unit_path or f"{HostPaths.unit_dir}/{self.unit}",
            self.env_path or f"{HostPaths.env_dir}/{self.ref.instance}.env",
        )


def parse_unit(text: str) -> UnitState | None:
    """``systemctl show`` output (``Key=Value`` lines) → ``UnitState``; None when it says nothing."""
    shown = shown_unit(show_properties(text))
    if shown is None or shown.active_state is None:
        return None
    return UnitState(shown.active_state, shown.sub_state or "", shown.n_restarts or 0, shown.main_pid or 0)


@dataclass(frozen=True)
class LiveInstance:
    unit: UnitState | None
    release: str | None
    revision: str | None  #: id of the unit and env file in place (``fleet.render.revision``)
    served_model: str | None  #: what that revision serves, from its ``revision.json``
    adapters: tuple[str, ...] | None = None  #: the LoRA adapters it serves, from its ``revision.json``


def served_model_of(meta: str) -> str | None:
    """The ``served_model`` of a revision's one-line ``revision.json``; None when unreadable."""
    try:
        value = json.loads(meta).get("served_model") if meta else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def adapters_of(meta: str) -> tuple[str, ...] | None:
    """The ``adapters`` of a revision's ``revision.json``; None when it records none (written
    before fleet recorded them, or stored from live files) or is unreadable."""
    try:
        value = json.loads(meta).get("adapters") if meta else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        return None
    return tuple(value)


def command_label(argv: Sequence[str]) -> str:
    """A command as errors name it: a script run by ``sh -c SCRIPT NAME ...`` by its NAME (never
    the script's text, which can be a thousand characters), anything else as its command line,
    shortened."""
    if len(argv) >= 4 and argv[0] == "sh" and argv[1] == "-c":
        return f"the {argv[3]} script"
    return sshlink.short(ssh_command(argv))


def one_line(text: str) -> str:
    """Output lines joined with `` | `` (an error is one line)."""
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


T = TypeVar("T")

#: Seconds a host found unreachable is not tried again (calls fail at once with the reason):
#: a silent host costs each observation nothing instead of a connect timeout.
RETRY_AFTER_S = 5.0


class _Conn:
    """One host's SSH connection, opened lazily and reopened once when it broke.

    A command on it has a deadline that holds when the host stops answering
    (``fleet.facts.sshlink.Link``). A host that went silent, or that cannot be connected to, is
    *unreachable*: the call fails with the reason at once, and for ``RETRY_AFTER_S`` seconds
    later calls fail the same way without trying; ``down_since`` is when it was last heard from.
    ``close`` works from any thread without waiting for a command or a connect in flight, and
    nothing is sent after it.
    """

    def __init__(
        self,
        target: SshTarget,
        *,
        silent_s: float = sshlink.SILENT_S,
        heartbeat_s: float = sshlink.HEARTBEAT_S,
        connect_s: float = sshlink.CONNECT_TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self.target = target
        self.silent_s, self.heartbeat_s, self.connect_s = silent_s, heartbeat_s, connect_s
        self.retry_after_s = retry_after_s
        self.link: sshlink.Link | None = None
        self.lock = threading.Lock()
        self.closed = False
        #: wall-clock time the host was last heard from, while it is unreachable; else None
        self.down_since: float | None = None
        self._down: sshlink.Unreachable | None = None
        self._retry_at = 0.0

    def _mark_down(self, exc: sshlink.Unreachable) -> None:
        if exc is self._down:
            return  # the same failure, reported again from the retry window: the window stays as it was
        if self.down_since is None:
            self.down_since = exc.since if exc.since is not None else time.time()
        self._down = exc
        self._retry_at = time.monotonic() + self.retry_after_s

    def _mark_up(self) -> None:
        self.down_since, self._down, self._retry_at = None, None, 0.0

    def _link(self, fresh: bool) -> sshlink.Link:
        with self.lock:
            if self.closed:
                raise ExecutorError(f"host {self.target.name}: not sent: fleet is stopping (its connection is closed)")
            link = self.link
            if link is not None and link.dead and self._down is None:
                self._mark_down(link._unreachable("the last command"))
            if link is not None and (fresh or not link.active):
                link.close()  # asked to, or the connection ended (e.g. the host rebooted)
                self.link = None
            if self.link is None:
                if self._down is not None and time.monotonic() < self._retry_at:
                    raise self._down
                try:
                    client = sshlink.connect(self.target, self.connect_s)
                except sshlink.Unreachable as exc:
                    self._mark_down(exc)
                    raise
                self.link = sshlink.Link(self.target.name, client, self.silent_s, self.heartbeat_s)
                if self.closed:  # closed while connecting
                    self.link.close()
                    raise ExecutorError(f"host {self.target.name}: not sent: fleet is stopping")
            return self.link

    def run(
        self, command: str, timeout: float, stdin: bytes = b"", *, resend: bool = True, label: str = ""
    ) -> tuple[int, str, str]:
        """Run ``command`` (named ``label`` in errors); on a connection that broke, reconnect once
        and send it again, unless it was already sent and ``resend`` is False (a command that must
        not run twice). A host that does not answer is not asked again within this call."""
        last: sshlink.SshError | None = None
        for attempt in range(2):
            sent = False
            try:
                link = self._link(fresh=attempt > 0)
                sent = True  # from here on the host may run it, even if no answer comes back
                result = link.run(command, timeout, stdin, label=label)
                self._mark_up()
                return result
            except sshlink.ConnectionLost as exc:
                last = exc
                if not resend:
                    raise ExecutorError(
                        f"host {self.target.name}: SSH failed after the command was sent (it may have run): "
                        f"{exc.reason}"
                    ) from None
            except sshlink.Unreachable as exc:
                self._mark_down(exc)
                if sent and not resend:
                    raise ExecutorError(f"{exc} (the command was sent: it may have run)") from None
                raise ExecutorError(str(exc)) from None
            except sshlink.SshError as exc:  # a refused host key or login, a command over its deadline
                raise ExecutorError(str(exc)) from None
        assert last is not None
        raise ExecutorError(str(last))

    def answer(self, fact: FactBase[T], command: str, timeout: float = DEFAULT_TIMEOUT) -> T | HostUnreachable:
        """A read-only fact's answer over this connection, as ``fleet.facts.runner.run_fact_on_hosts``
        gives it on a connection of its own: the processed value, or ``HostUnreachable`` with SSH's
        reason (``ssh_failed``), the command's exit status, or why its output cannot be read. A read
        is sent again on a new connection when the one it went out on broke (it changes nothing)."""
        name = self.target.name
        for attempt in range(2):
            try:
                rc, out, err = self._link(fresh=attempt > 0).run(command, timeout)
            except sshlink.ConnectionLost as exc:
                if attempt == 0:
                    continue
                return HostUnreachable(name, exc.reason, ssh_failed=True)
            except sshlink.Unreachable as exc:
                self._mark_down(exc)
                return HostUnreachable(name, exc.reason, ssh_failed=True)
            except sshlink.SshError as exc:  # a refused host key or login, a command over its deadline
                return HostUnreachable(name, exc.reason, ssh_failed=True)
            except ExecutorError as exc:  # closed: fleet is stopping
                return HostUnreachable(name, str(exc))
            self._mark_up()
            return fact_answer(name, fact, rc, out, err)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns

    def close(self) -> None:
        """Close the connection now; later calls fail at once (``ExecutorError``)."""
        self.closed = True
        link = self.link
        if link is not None:
            link.close()


#: One connection per host, each opened on first use: a command's read round and its executor share them.
Connections = dict[str, _Conn]


def connections(targets: Mapping[str, SshTarget]) -> Connections:
    """A (not yet opened) connection to each of ``targets``."""
    return {name: _Conn(t) for name, t in targets.items()}


def read_fact(
    conns: Mapping[str, _Conn], hosts: Sequence[str], fact_cls: type[FactBase[T]], **args: Any
) -> dict[str, T | HostUnreachable]:
    """``fact_cls`` on each of ``hosts`` over its connection in ``conns``, all hosts at once:
    ``run_fact_on_hosts``'s answers without a connection of its own per host and fact."""
    fact = fact_cls()
    command = str(fact.command(**args))
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        answers = list(pool.map(lambda h: conns[h].answer(fact, command), hosts))
    return dict(zip(hosts, answers, strict=True))


#: Seconds a hook on a host gets after SIGTERM (coreutils ``timeout -k``) before SIGKILL.
HOOK_KILL_AFTER_S = 5.0


def host_hook_command(argv: Sequence[str], timeout_s: float) -> str:
    """The command line that runs a hook on a host: its argv under coreutils ``timeout``, escaped."""
    if not argv:
        raise ExecutorError("an empty hook command")
    return ssh_command(["timeout", "-k", f"{HOOK_KILL_AFTER_S:g}", f"{timeout_s:g}", *argv])


def host_hook_result(host: str, argv: Sequence[str], timeout_s: float, rc: int, out: str, err: str) -> str:
    """A host hook's output, or the ``ExecutorError`` its exit status means (coreutils ``timeout``:
    124 timed out, 137 killed after the grace, 126 not executable, 127 not found)."""
    name = f"host {host}: hook {argv[0]}"
    tail = (err or out).strip()[-300:]
    if rc == 0:
        return out
    if rc in (124, 128 + 9):  # 137: SIGKILLed after the grace
        raise ExecutorError(f"{name} timed out after {timeout_s:g}s (hooks.timeout_s) and was ended on the host")
    if rc == 127:
        raise ExecutorError(f"{name}: command not found on the host ({tail or 'no such file'}); install it there")
    if rc == 126:
        raise ExecutorError(f"{name}: not executable on the host ({tail})")
    raise ExecutorError(f"{name} exited {rc}: {tail}")


class SshProber(InstanceProber):
    """The HTTP probes of ``InstanceProber``, made by ``curl`` on the instance's host over SSH."""

    def __init__(self, conn: _Conn, port: int, timeout_s: float, api_key: str | None = None) -> None:
        super().__init__(f"http://127.0.0.1:{port}", timeout_s, api_key)
        self._conn = conn
        self._key = api_key

    def _request(self, path: str, body: dict[str, Any] | None = None) -> _Reply:
        argv = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--max-time", f"{self.timeout_s:g}"]
        argv += ["-H", "content-type: application/json", "-H", "@-"]  # headers from stdin: the key stays out of argv
        if body is not None:
            argv += ["--data-binary", json.dumps(body)]
        argv.append(self.base_url + path)
        header = f"authorization: Bearer {self._key}\n".encode() if self._key else b"x-fleet-probe: 1\n"
        t0 = time.monotonic()
        try:
            rc, out, err = self._conn.run(ssh_command(argv), self.timeout_s + 10, stdin=header, label=f"curl {path}")
        except ExecutorError as exc:
            return _Reply(None, b"", str(exc), time.monotonic() - t0)
        elapsed = time.monotonic() - t0
        payload, _, code = out.rpartition("\n")
        if rc == 28:
            return _Reply(None, b"", f"timed out after {self.timeout_s:g}s", elapsed)
        if rc == 7:
            return _Reply(None, b"", "connection refused", elapsed)
        if rc != 0 or not code.strip().isdigit():
            return _Reply(None, b"", f"curl on the host exited {rc}: {err.strip()[:200]}", elapsed)
        return _Reply(int(code), payload.encode(), "", elapsed)


class SshExecutor:
    """``fleet.rollout.executor.Executor`` for hosts reached over SSH (see the module docstring)."""

    #: this rollout's claims on its hosts (``fleet.rollout.claims``), when the session took them
    claims: HostClaims | None = None
    #: hosts this rollout leaves out (drained for maintenance: ``fleet.rollout.session.run_rollout``)
    skipped: frozenset[str] = frozenset()

    def __init__(
        self,
        targets: Mapping[str, SshTarget],
        instances: Mapping[InstanceRef, InstanceSpec],
        *,
        root: str = DEFAULT_ROOT,
        revisions: str = rev.ROOT,
        api_keys: Mapping[str, str | None] | None = None,
        http_timeout_s: float = 5.0,
        gates_over_ssh: Collection[str] = (),
        ssh_timeout_s: float = SSH_TIMEOUT_S,
        traffic: Traffic | None = None,
        conns: Mapping[str, _Conn] | None = None,
    ) -> None:
        missing = sorted({r.host for r in instances} - set(targets))
        if missing:
            raise FleetError(f"no SSH settings for host(s) {', '.join(missing)}")
        self.targets = dict(targets)
        self.instances = dict(instances)
        self.root = root.rstrip("/")
        self.revisions = revisions.rstrip("/")
        self.http_timeout_s = http_timeout_s
        self.gates_over_ssh = frozenset(gates_over_ssh)
        self.ssh_timeout_s = ssh_timeout_s
        self.__keys = dict(api_keys or {})
        #: ``conns``: connections opened already (the command's read round), used instead of new ones
        given = conns or {}
        self._conns = {name: given.get(name) or _Conn(t) for name, t in self.targets.items()}
        self._units: dict[InstanceRef, tuple[float, UnitState | None]] = {}
        #: the load balancers in front of the instances (empty: none, or ``--no-lb``)
        self.traffic = traffic or Traffic({})

    def __repr__(self) -> str:
        return f"SshExecutor(hosts={sorted(self.targets)}, api_keys={'<set>' if any(self.__keys.values()) else None})"

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self.traffic.close()

    # ---- plumbing --------------------------------------------------------------------------------

    def read_fact(self, hosts: Sequence[str], fact_cls: type[FactBase[T]]) -> dict[str, T | HostUnreachable]:
        """A read-only fact on ``hosts`` over this executor's connections, all at once
        (:func:`read_fact`): the connection each host's steps then use."""
        return read_fact(self._conns, hosts, fact_cls)

    def spec(self, ref: InstanceRef) -> InstanceSpec:
        try:
            return self.instances[ref]
        except KeyError:
            raise ExecutorError(f"{ref}: not an instance of this inventory") from None

    def run(self, host: str, argv: Sequence[str], *, sudo: bool = False, timeout: float | None = None) -> str:
        """Run ``argv`` on ``host`` (``sudo -n`` when asked); its stdout, or ``ExecutorError``
        naming the command in a few words (``command_label``) and its last output lines."""
        full = ["sudo", "-n", *argv] if sudo else list(argv)
        label = command_label(argv)
        rc, out, err = self._conns[host].run(ssh_command(full), timeout or self.ssh_timeout_s, label=label)
        if rc != 0:
            raise ExecutorError(f"host {host}: {label} exited {rc}: {one_line((err or out).strip()[-300:])}")
        return out

    def prober(self, ref: InstanceRef, timeout_s: float | None = None) -> InstanceProber:
        """HTTP to the instance, each request bounded by ``timeout_s`` (default: ``http_timeout_s``)."""
        s = self.spec(ref)
        key = self.__keys.get(ref.host)
        timeout = self.http_timeout_s if timeout_s is None else timeout_s
        if ref.host in self.gates_over_ssh:
            return SshProber(self._conns[ref.host], s.port, timeout, key)
        return InstanceProber(s.url, timeout, key)

    # ---- observing -------------------------------------------------------------------------------

    def unit_and_release(self, ref: InstanceRef) -> tuple[UnitState | None, str | None]:
        live = self.live(ref)
        return live.unit, live.release

    def live(self, ref: InstanceRef) -> LiveInstance:
        """The unit's state, the release the instance runs and its live configuration revision.

        A running instance runs the release its process was started from: the interpreter in
        ``/proc/<MainPID>/cmdline`` (the ``vllm`` console script's shebang names the release's
        own venv, ``<root>/releases/<id>/bin/python``, as pip writes it). The ``current`` link is
        per host, so after a canary on one instance it names a release the host's other
        instances do not run yet. A stopped instance will run what ``current`` names.
        """
        s = self.spec(ref)
        script = (
            'systemctl show -p "$3" -- "$1" || exit $?; printf "current=%s\\n" "$(readlink -- "$2/current")"; '
            f'printf "exe=%s\\n" "$({main_exe_sh(_UNIT_ARG)})"; U=$4; E=$5; '
            f'if [ -f "$U" ] && [ -f "$E" ]; then r=$({rev.LIVE_ID_SH}); printf "revision=%s\\n" "$r"; '
            f'm="$6/$r/{rev.META}"; [ -f "$m" ] && printf "meta=%s\\n" "$(head -c 4096 "$m" | tr -d "\\n")"; fi; true'
        )
        unit_file, env_file = s.files
        argv = ["sh", "-c", script, "fleet-facts", s.unit, self.root, ",".join(UNIT_PROPS), unit_file, env_file,
                f"{self.revisions}/{ref.instance}"]  # fmt: skip
        # root: the env file and the revision store are root-only
        rc, out, err = self._conns[ref.host].run(
            ssh_command(["sudo", "-n", *argv]), self.ssh_timeout_s, label=f"reading the state of {s.unit}"
        )
        if rc != 0:
            raise ExecutorError(f"host {ref.host}: systemctl show {s.unit} exited {rc}: {err.strip()[-300:]}")
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        unit = parse_unit(out)
        exe = values.get("exe") if unit is not None and unit.main_pid else None
        return LiveInstance(
            unit,
            running_release(exe, release_of(values.get("current", "")), self.root),
            values.get("revision") or None,
            served_model_of(values.get("meta", "")),
            adapters_of(values.get("meta", "")),
        )

    def gpu_processes(self, ref: InstanceRef) -> tuple[GpuProcess, ...]:
        """Compute processes on the instance's GPUs through NVML; ours = in the unit's cgroup."""
        s = self.spec(ref)
        python = f"{self.root}/current/bin/python"
        rc, out, err = self._conns[ref.host].run(
            ssh_command(["sudo", "-n", "sh", "-c", probe_command(python, CODE_CACHE)]),
            self.ssh_timeout_s,
            label="the NVML probe",
        )
        if rc != 0:
            raise ExecutorError(f"host {ref.host}: the NVML probe exited {rc}: {err.strip()[-300:]}")
        try:
            facts = parse_probe_output(out.splitlines())
        except FleetError as exc:
            raise ExecutorError(f"host {ref.host}: NVML probe: {exc}") from exc
        if not facts.ok:
            raise ExecutorError(
                f"host {ref.host}: NVML probe: {facts.status}: {facts.error_message or facts.error_class}; "
                "cannot tell whether the instance's GPUs are free"
            )
        procs = []
        for gpu in facts.gpus:
            if gpu.index not in s.gpus:
                continue
            if gpu.processes is None:
                raise ExecutorError(f"host {ref.host}: NVML could not list the processes on GPU {gpu.index}")
            for p in gpu.processes:
                procs.append(GpuProcess(p.pid, p.comm or "?", gpu.index, p.used_memory or 0, p.unit == s.unit))
        return tuple(procs)

    def facts(self, ref: InstanceRef) -> InstanceFacts:
        s = self.spec(ref)
        taken = self.claims.lost_on(ref.host) if self.claims is not None else ""
        if taken:
            return InstanceFacts(ref, claimed_by=taken)  # another rollout has the host: not asked, not touched
        try:
            live = self.live(ref)
            unit, release = live.unit, live.release
            self._units[ref] = (time.monotonic(), unit)
            running = unit is not None and unit.active_state in ("active", "activating", "reloading", "deactivating")
            gpus = () if running else self.gpu_processes(ref)
        except ExecutorError as exc:
            since = self._conns[ref.host].down_since
            return InstanceFacts(ref, unreachable=str(exc), unreachable_since=since)
        in_flight: float | None = None
        serving = False
        if unit is not None and not unit.main_pid:
            in_flight = 0.0  # no process: nothing can be in flight (e.g. a unit waiting to auto-restart)
        if unit is not None and unit.active_state == "active" and not s.headless:
            prober = self.prober(ref)
            serving = prober.health().status == 200
            in_flight = prober.in_flight() if serving else None
        lb, lb_error = None, ""
        try:
            lb = self.traffic.view(ref.host, ref.instance)
        except BalancerError as exc:
            lb_error = str(exc)
        return InstanceFacts(
            ref,
            unit=unit,
            release=release,
            model=live.served_model or s.model,
            revision=live.revision,
            adapters=live.adapters,
            gpu_processes=gpus,
            in_flight=in_flight,
            serving=serving,
            lb=lb,
            lb_error=lb_error,
        )

    def probe(self, ref: InstanceRef, policy: RolloutPolicy, model: str) -> Probe:
        self.spec(ref)  # an unknown instance is an ExecutorError, as for every step
        seen = self._units.get(ref)
        if seen is not None and time.monotonic() - seen[0] < UNIT_FRESH_S:
            unit = seen[1]  # ``facts`` read it a moment ago (the runner asks for facts, then the probe)
        else:
            try:
                unit, _release = self.unit_and_release(ref)
            except ExecutorError as exc:
                return Probe(time.time(), unreachable=str(exc))
        # ``probe_timeout_s`` bounds each gate request: a completion from an engine that is alive
        # but hung (or stalled) is a timeout after that long, not after the executor's default.
        probe = self.prober(ref, policy.probe_timeout_s).probe(model, policy, unit)
        return replace(probe, gpu_events=self.gpu_events(ref))

    def gpu_events(self, ref: InstanceRef) -> GpuEvents | None:
        """The GPU watcher's events on the instance's GPUs since its unit started (the gates' gpu
        gate); None where the host has no watcher record or it cannot be read (not observed)."""
        s = self.spec(ref)
        try:
            rc, out, _err = self._conns[ref.host].run(
                ssh_command(["sudo", "-n", *since_start_argv(s.unit, s.gpus)]),
                self.ssh_timeout_s,
                label="reading the GPU watcher's record",
            )
        except ExecutorError:
            return None
        status, events = parse_since_start(out) if rc == 0 else ("bad-output", [])
        if status != "ok":
            return None
        return GpuEvents(tuple(GpuEventSeen(gpu, e.at, e.describe(), e.action) for gpu, e in events))

    # ---- acting ----------------------------------------------------------------------------------

    def stop_unit(self, ref: InstanceRef) -> str:
        unit = self.spec(ref).unit
        self.run(ref.host, ["systemctl", "stop", "--", unit], sudo=True, timeout=STOP_TIMEOUT_S)
        # systemctl stop returns 0 after a SIGKILL at TimeoutStopSec too: the unit's Result tells.
        shown = self.run(ref.host, ["systemctl", "show", "-p", ",".join(STOP_PROPS), "--", unit])
        return stop_outcome(show_properties(shown))

    def start_unit(self, ref: InstanceRef) -> None:
        s = self.spec(ref)
        # A unit that failed (or hit its start limit) must be reset before systemd starts it again.
        self.run(ref.host, ["systemctl", "reset-failed", "--", s.unit], sudo=True)
        self.run(ref.host, ["systemctl", "start", "--", s.unit], sudo=True)

    def kill(self, ref: InstanceRef, pids: Sequence[int]) -> None:
        """SIGTERM the orphans, give them 10 s, then SIGKILL the survivors; confirm they are gone."""
        if not pids:
            return
        words = [str(int(p)) for p in pids]
        script = (
            'kill -TERM "$@" 2>/dev/null; i=0; while [ $i -lt 20 ]; do alive=; for p in "$@"; do '
            'kill -0 "$p" 2>/dev/null && alive=1; done; [ -z "$alive" ] && exit 0; sleep 0.5; i=$((i+1)); done; '
            'kill -KILL "$@" 2>/dev/null; sleep 1; for p in "$@"; do kill -0 "$p" 2>/dev/null && '
            'echo "pid $p survived SIGKILL" >&2 && exit 1; done; exit 0'
        )
        self.run(ref.host, ["sh", "-c", script, "fleet-kill", *words], sudo=True, timeout=60)

    def flip_release(self, ref: InstanceRef, release: str, revision: str | None = None) -> None:
        """``current`` → ``releases/<release>`` (the old target becomes ``previous``), atomically;
        with ``revision``, the instance's unit and env file become that stored revision's (what is
        live is stored first, when it is not, so a rollback can put it back), then daemon-reload.

        Refused for a release whose marker file is missing or a revision that is not stored."""
        if not release or "/" in release or release in (".", ".."):
            raise ExecutorError(f"{ref}: {release!r} is not a release name")
        if revision is not None and not (revision.isalnum() and len(revision) == rev.ID_LENGTH):
            raise ExecutorError(f"{ref}: {revision!r} is not a configuration revision id")
        unit_file, env_file = self.spec(ref).files
        script = (
            "set -e; umask 077; r=$1; rel=$2; marker=$3; U=$4; E=$5; store=$6; want=$7; "
            '[ -f "$r/releases/$rel/$marker" ] || '
            '{ echo "release $rel is not installed (no $r/releases/$rel/$marker)" >&2; exit 3; }; '
            f"{SWITCH_SH}; "
            '[ -n "$want" ] || exit 0; d="$store/$want"; '
            f'[ -f "$d/{rev.META}" ] || {{ echo "configuration revision $want is not stored on the host '
            f'(no $d/{rev.META}): run fleet deploy" >&2; exit 3; }}; '
            f'if [ -f "$U" ] && [ -f "$E" ]; then live=$({rev.LIVE_ID_SH}); [ "$live" = "$want" ] && exit 0; '
            f'if [ ! -f "$store/$live/{rev.META}" ]; then mkdir -p "$store/$live"; '
            f'cp -- "$U" "$store/$live/{rev.UNIT}"; '
            f'cp -- "$E" "$store/$live/{rev.ENV}"; printf \'{{"id": "%s", "saved": "live"}}\\n\' "$live" '
            f'> "$store/$live/{rev.META}"; fi; fi; '
            f'cp -- "$d/{rev.UNIT}" "$U.fleet-tmp"; chmod 644 "$U.fleet-tmp"; mv -fT "$U.fleet-tmp" "$U"; '
            f'cp -- "$d/{rev.ENV}" "$E.fleet-tmp"; chmod 600 "$E.fleet-tmp"; mv -fT "$E.fleet-tmp" "$E"; '
            "systemctl daemon-reload"
        )
        argv = ["sh", "-c", script, "fleet-switch", self.root, release, MARKER, unit_file, env_file,
                f"{self.revisions}/{ref.instance}", revision or ""]  # fmt: skip
        self.run(ref.host, argv, sudo=True)

    def set_lb_state(self, ref: InstanceRef, state: str) -> None:
        """``set server <backend>/<server> state <state>`` on the instance's load balancer."""
        try:
            self.traffic.set_state(ref.host, ref.instance, AdminState(state))
        except BalancerError as exc:
            raise ExecutorError(str(exc)) from exc

    def run_hook(self, ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        """A drain/undrain hook: on this machine, or (``on=HookPlace.HOST``) on ``ref``'s host as
        the SSH user. Placeholders were filled in per argument by the policy; no shell either way."""
        if on is HookPlace.HOST:
            command = host_hook_command(argv, timeout_s)
            rc, out, err = self._conns[ref.host].run(
                command, timeout_s + HOOK_KILL_AFTER_S + 10, resend=False, label=f"the {argv[0]} hook"
            )
            return host_hook_result(ref.host, argv, timeout_s, rc, out, err)
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ExecutorError(f"hook {argv[0]}: {exc}") from exc
        if done.returncode:
            raise ExecutorError(f"hook {argv[0]} exited {done.returncode}: {done.stderr.strip()[-300:]}")
        return done.stdout

    # ---- who is rolling a host (``fleet.rollout.claims``) ----------------------------------------

    def claim_host(self, host: str, request: ClaimRequest, mode: str, stale: str = "") -> ClaimAnswer:
        """Claim, renew or release ``host`` for ``request``'s rollout (root-only file under fleet's
        state directory, atomic rename under ``flock``); ``stale``: a rollout whose claim may be
        replaced (its owner is known gone). The host's answer; ``ExecutorError`` when it cannot be asked."""
        who = [request.rollout_id, request.machine, request.user, str(request.pid), str(request.lease_s)]
        argv = ["sh", "-c", claim_script(), "fleet-claim", STATE_DIR, mode, *who, request.pid_start,
                safe_word(stale or "-")]  # fmt: skip
        out = self.run(host, argv, sudo=True, timeout=60)
        try:
            return parse_answer(out)
        except ValueError as exc:
            raise ExecutorError(f"host {host}: claiming it for the rollout: {exc}") from None

    # ---- maintenance (``fleet drain``/``fleet undrain``) --------------------------------------------

    def write_root_file(self, host: str, path: str, content: str, mode: int = 0o600) -> None:
        """``content`` into ``path`` on ``host``, owned by root with ``mode``, atomically
        (``fleet.operations.files.write_command``: the text travels on stdin, never in argv)."""
        command = write_command(path, content.encode(), mode, "root", "root")
        stdin = str(command.connector_arguments.get("_stdin") or "").encode()
        rc, out, err = self._conns[host].run("sudo -n " + command.get_raw_value(), self.ssh_timeout_s, stdin=stdin)
        if rc != 0:
            raise ExecutorError(f"host {host}: writing {path} exited {rc}: {(err or out).strip()[-300:]}")

    def remove_file(self, host: str, path: str) -> None:
        self.run(host, ["rm", "-f", "--", path], sudo=True)

    def set_enabled(self, host: str, units: Sequence[str], enabled: bool) -> None:
        """``systemctl enable``/``disable`` the units (whether they start at boot)."""
        if units:
            self.run(host, ["systemctl", "enable" if enabled else "disable", "--", *units], sudo=True)

    # ---- releases (for ``fleet rollback``) -------------------------------------------------------

    def links(self, host: str) -> tuple[str | None, str | None]:
        """(current, previous) release of a host."""
        link = ["readlink", "--"]
        cur = ssh_command([*link, f"{self.root}/current"])
        prev = ssh_command([*link, f"{self.root}/previous"])
        rc, out, err = self._conns[host].run(
            f'printf "current=%s\\nprevious=%s\\n" "$({cur})" "$({prev})"',
            self.ssh_timeout_s,
            label="reading the release links",
        )
        if rc != 0:
            raise ExecutorError(f"host {host}: reading the release links exited {rc}: {err.strip()}")
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return release_of(values.get("current", "")), release_of(values.get("previous", ""))

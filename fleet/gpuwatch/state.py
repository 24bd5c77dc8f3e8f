"""A host's GPU watcher record as fleet reads it: per GPU its events and whether it is quarantined.

:class:`GpuWatchState` is a pyinfra fact: as root (already, or ``sudo -n``: the record directory
is root-only) it prints the host's ``/etc/machine-id``, the watcher's ``record.json`` and
``clears.json`` (``fleet.gpuwatch.watcher``), and :func:`parse_watch_state` validates them (they
come from a host) into :class:`WatchState`. A record another machine wrote (a cloned disk) or one
that is not a watcher record is a status with the reason, never a guess; no record at all is
``none`` (the watcher is not deployed, or has not begun). Quarantine is the watcher's own rule,
:func:`fleet.gpuwatch.catalog.quarantine_since` over the record and the clears.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.gpuwatch import catalog
from fleet.gpuwatch.watcher import CLEARS, DEFAULT_STATE_DIR, RECORD, cleared_through, record_problem
from fleet.inventory.spec import LoadedInventory

STATUSES = ("ok", "none", "no-root", "foreign", "bad-record", "bad-output")
_MARK = "--fleet-gpu-watch--"


@dataclass(frozen=True)
class GpuEvent:
    seq: int
    at: float
    kind: str  #: xid, sbe, dbe
    xid: int | None
    action: str  #: fleet.gpuwatch.catalog.ACTIONS
    meaning: str

    @property
    def critical(self) -> bool:
        return self.action in catalog.CRITICAL

    def describe(self) -> str:
        what = f"XID {self.xid}" if self.kind == "xid" else self.kind.upper()
        return f"{what} ({self.action}): {self.meaning}"


@dataclass(frozen=True)
class GpuWatch:
    uuid: str
    index: int | None
    bus_id: str
    events: tuple[GpuEvent, ...]
    cleared_through: int  #: the last ``fleet gpu clear`` covers events up to this seq
    quarantine: GpuEvent | None  #: the first critical event after the last clear

    @property
    def quarantined(self) -> bool:
        return self.quarantine is not None


@dataclass(frozen=True)
class WatchState:
    status: str
    error: str | None = None
    record_id: str = ""
    seq: int = 0  #: the record's last sequence number
    gpus: tuple[GpuWatch, ...] = ()
    clears: Any = field(default=None, compare=False)  #: clears.json as read (``fleet gpu clear`` appends)
    #: why ``clears.json`` cannot be used (not JSON, not a clears file): its GPUs count as never
    #: cleared, and ``fleet gpu clear`` refuses to write over it (it keeps who cleared what before)
    clears_problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def quarantined(self) -> dict[int, GpuEvent]:
        """GPU index -> the event that quarantined it."""
        return {g.index: g.quarantine for g in self.gpus if g.quarantine is not None and g.index is not None}

    def gpu(self, index: int) -> GpuWatch | None:
        return next((g for g in self.gpus if g.index == index), None)

    def events_since(self, record_id: str, seq: int, indices: Collection[int]) -> list[tuple[int, GpuEvent]]:
        """Events of the GPUs ``indices`` after ``seq`` of record ``record_id`` (every event of a
        record begun since: the old one was moved aside), in order."""
        after = seq if record_id == self.record_id else 0
        out = [
            (g.index, e)
            for g in self.gpus
            if g.index is not None and g.index in indices
            for e in g.events
            if e.seq > after
        ]
        return sorted(out, key=lambda ie: ie[1].seq)


def watch_command(state_dir: str = DEFAULT_STATE_DIR) -> str:
    """As root, the machine id, the record and the clears, each after a marker line; exits 0."""
    record, clears = shlex.quote(f"{state_dir}/{RECORD}"), shlex.quote(f"{state_dir}/{CLEARS}")
    no_root = shlex.quote(json.dumps({"status": "no-root"}))
    show = (
        f"exec 2>/dev/null; echo {_MARK}machine-id; cat /etc/machine-id; "
        f"printf '\\n%s\\n' {_MARK}record; cat {record}; printf '\\n%s\\n' {_MARK}clears; cat {clears}; true"
    )
    return (
        'if [ "$(id -u)" = 0 ]; then S=; elif sudo -n true 2>/dev/null; then S="sudo -n"; else '
        f"echo {_MARK}{no_root}; exit 0; fi; "
        f"$S sh -c {shlex.quote(show)}"
    )


def _sections(lines: Sequence[str]) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in lines:
        if line.startswith(_MARK):
            current = line[len(_MARK) :]
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v).strip() for k, v in out.items()}


def _event(raw: Any) -> GpuEvent:
    if not isinstance(raw, dict):
        raise ValueError(f"event {raw!r}")
    kind = raw.get("kind")
    xid = raw.get("xid")
    if kind not in catalog.KINDS or (xid is not None and (not isinstance(xid, int) or isinstance(xid, bool))):
        raise ValueError(f"event kind={kind!r} xid={xid!r}")
    action = raw.get("action")
    if action not in catalog.ACTIONS:
        raise ValueError(f"event action={action!r}")
    at = raw.get("t")
    if not isinstance(at, int | float) or isinstance(at, bool):
        raise ValueError(f"event t={at!r}")
    return GpuEvent(int(raw["seq"]), float(at), str(kind), xid, str(action), str(raw.get("meaning", ""))[:300])


def parse_watch_state(lines: Sequence[str]) -> WatchState:
    """The fact's output -> :class:`WatchState` (pure)."""
    parts = _sections(lines)
    if not parts:
        return WatchState("bad-output", f"no marker in the output: {' '.join(lines)[:120]!r}")
    first = next(iter(parts))
    if first.startswith("{"):
        return WatchState("no-root", "root is needed to read the watcher's record; sudo -n refused")
    machine_id, record_text, clears_text = parts.get("machine-id", ""), parts.get("record", ""), parts.get("clears", "")
    if not record_text:
        return WatchState("none", "no watcher record on the host (fleet deploy installs the watcher)")
    try:
        raw = json.loads(record_text)
    except json.JSONDecodeError as exc:
        return WatchState("bad-record", f"{RECORD} is not JSON ({exc})")
    why = record_problem(raw)
    if why is not None:
        return WatchState("bad-record", f"{RECORD}: {why}")
    if machine_id and raw["machine_id"] != machine_id:
        return WatchState(
            "foreign",
            f"{RECORD} was written on machine {raw['machine_id'][:32]!r}, this host is {machine_id[:32]!r} "
            "(a cloned disk?): the watcher moves it aside when it starts (systemctl restart fleet-gpu-watch)",
        )
    clears, clears_problem = _clears(clears_text)
    gpus = []
    try:
        for uuid, entry in sorted(raw["gpus"].items()):
            events = tuple(sorted((_event(e) for e in entry["events"]), key=lambda e: e.seq))
            through = cleared_through(clears, raw["record_id"], uuid)
            first_critical = next((e for e in events if e.critical and e.seq > through), None)
            index = entry.get("index")
            gpus.append(GpuWatch(str(uuid), index if isinstance(index, int) and not isinstance(index, bool) else None,
                                 str(entry.get("bus_id", "")), events, through, first_critical))  # fmt: skip
    except (ValueError, TypeError, KeyError) as exc:
        return WatchState("bad-record", f"{RECORD}: {exc}"[:300])
    return WatchState("ok", None, raw["record_id"], raw["seq"], tuple(gpus), clears, clears_problem)


def _clears(text: str) -> tuple[dict[str, Any], str | None]:
    """``clears.json`` as read, or ``{}`` and why it cannot be used (pure)."""
    if not text:
        return {}, None
    try:
        clears = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"{CLEARS} is not JSON ({exc})"
    if not isinstance(clears, dict) or not isinstance(clears.get("gpus", {}), dict):
        return {}, f"{CLEARS} is not a record of clears (a JSON object whose gpus is an object): {text[:80]!r}"
    for uuid, entries in clears.get("gpus", {}).items():
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            return {}, f"{CLEARS}: gpus[{str(uuid)[:60]}] is not a list of clears"
    return clears, None


class GpuWatchState(FactBase[WatchState]):
    """
    The GPU watcher's record on the host: each GPU's events and quarantine (read as root).
    """

    @override
    def command(self, state_dir: str = DEFAULT_STATE_DIR) -> str:
        return watch_command(state_dir)

    @override
    def process(self, output: list[str]) -> WatchState:
        return parse_watch_state(output)


#: Run on the host as root with ``python3 -I -c``: argv = state dir, unit, GPU indices (comma
#: separated). Prints one JSON object: the events of those GPUs the watcher recorded since the
#: unit's main process started (its ``ExecMainStartTimestampMonotonic`` on the host's own
#: monotonic clock, turned into the host's wall clock the record's times use), or ``none`` when
#: there is no record. Python 3.6, standard library only.
_SINCE_START = r"""
import json, os, subprocess, sys, time
state, unit, gpus = sys.argv[1], sys.argv[2], set(int(g) for g in sys.argv[3].split(",") if g)
out = {"status": "ok", "events": []}
try:
    with open(os.path.join(state, "record.json")) as f:
        record = json.load(f)
except FileNotFoundError:
    out = {"status": "none"}
except (OSError, ValueError) as exc:
    out = {"status": "bad-record", "error": str(exc)[:200]}
else:
    shown = subprocess.run(["systemctl", "show", "-p", "ExecMainStartTimestampMonotonic", "--value", "--", unit],
                           stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()
    mono = int(shown) / 1e6 if shown.isdigit() and int(shown) > 0 else None
    since = time.time() - (time.monotonic() - mono) if mono is not None else None
    out["since"] = since
    for uuid, g in sorted((record.get("gpus") or {}).items()):
        if g.get("index") in gpus:
            for e in g.get("events") or []:
                if since is not None and isinstance(e.get("t"), (int, float)) and e["t"] >= since:
                    out["events"].append(dict(e, gpu=g["index"]))
print(json.dumps(out))
"""


def since_start_argv(unit: str, gpus: Collection[int], state_dir: str = DEFAULT_STATE_DIR) -> list[str]:
    """The command (for ``sudo -n``) that prints the watcher's events on ``gpus`` since ``unit`` started."""
    return ["python3", "-I", "-c", _SINCE_START, state_dir, unit, ",".join(str(int(g)) for g in sorted(gpus))]


def parse_since_start(text: str) -> tuple[str, list[tuple[int, GpuEvent]]]:
    """``since_start_argv``'s output -> (status, [(gpu index, event)]) (pure); status ``ok``,
    ``none`` (no watcher record), ``bad-record`` or ``bad-output``."""
    try:
        raw = json.loads(text.strip().splitlines()[-1]) if text.strip() else None
    except json.JSONDecodeError:
        raw = None
    if not isinstance(raw, dict) or raw.get("status") not in ("ok", "none", "bad-record"):
        return "bad-output", []
    events = []
    try:
        for e in raw.get("events") or []:
            gpu = e.get("gpu") if isinstance(e, dict) else None
            if not isinstance(gpu, int) or isinstance(gpu, bool):
                raise ValueError(f"event without a GPU: {e!r}")
            events.append((gpu, _event(e)))
    except (ValueError, TypeError, KeyError):
        return "bad-record", []
    return str(raw["status"]), sorted(events, key=lambda ge: ge[1].seq)


def quarantine_of(state: WatchState | object) -> dict[int, str]:
    """GPU index -> why it is quarantined, from a host's watcher record (empty: none, or no
    record to read: a host without the watcher is planned as before)."""
    if not isinstance(state, WatchState) or not state.ok:
        return {}
    return {i: e.describe() for i, e in sorted(state.quarantined().items())}


def quarantine_and_unread(
    answers: Mapping[str, WatchState | object], hosts: Sequence[str]
) -> tuple[dict[str, dict[int, str]], dict[str, str]]:
    """Each host's quarantined GPUs, and why a host's record could not be used (pure).

    ``answers``: the :class:`GpuWatchState` fact per host (a ``HostUnreachable`` or anything else:
    not read). A host whose record cannot be read or trusted is planned as before and named in
    the second map with the reason; a host without a record (``none``: no watcher yet) too."""
    held: dict[str, dict[int, str]] = {}
    unread: dict[str, str] = {}
    for host in hosts:
        answer = answers.get(host)
        if isinstance(answer, WatchState) and answer.ok:
            if q := quarantine_of(answer):
                held[host] = q
            continue
        if isinstance(answer, WatchState):
            why = f"{answer.status}: {answer.error}" if answer.error else answer.status
        elif answer is None:
            why = "not read"
        else:
            why = str(getattr(answer, "reason", answer))
        unread[host] = f"its GPU watcher record could not be read ({why}); planned without a quarantine"
    return held, unread


def read_quarantine(
    loaded: LoadedInventory, timeout: float = 20.0, connect_timeout: float | None = None
) -> dict[str, dict[int, str]]:
    """Each selected host's quarantined GPUs (all hosts at once; one SSH round trip each)."""
    from fleet.facts.runner import run_fact_on_hosts, targets_from_inventory

    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    results = run_fact_on_hosts(targets, GpuWatchState, timeout=timeout, connect_timeout=connect_timeout)
    return {name: q for name, r in results.items() if (q := quarantine_of(r))}

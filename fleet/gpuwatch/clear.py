"""``fleet gpu clear HOST GPU``: lift a GPU's quarantine after repair, with who, when and why.

Deciding is pure (:func:`clear_entry`): the host's watcher record must be readable and this
host's own, the GPU must be one the record knows, and quarantined; the entry says through which
sequence number of which record the GPU is cleared (the watcher's own rule,
``fleet.gpuwatch.watcher.cleared_through``: a critical event after it quarantines the GPU
again). Acting (:func:`clear_gpu`): ``clears.json`` is rewritten atomically as root (0600, a
temporary file renamed over it), keeping every earlier entry, and the clear is written to the
host's system journal (``logger -t fleet-gpu-clear``); the watcher re-reads the file and exports
the GPU as no longer quarantined.
"""

from __future__ import annotations

import base64
import json
import shlex
from typing import Any

from fleet.errors import FleetError
from fleet.facts.runner import SshTarget, run_command
from fleet.facts.sshlink import SshError
from fleet.gpuwatch.state import GpuWatch, WatchState, parse_watch_state, watch_command
from fleet.gpuwatch.watcher import CLEARS, DEFAULT_STATE_DIR

KEEP_CLEARS = 20  #: entries kept per GPU


class ClearRefused(FleetError):
    """The GPU cannot be cleared as asked (no such GPU, not quarantined): bad input, nothing written."""


_WRITE = (
    'set -e; umask 077; tmp="$1/.$2.fleet-tmp"; rm -f -- "$tmp"; printf %s "$3" | base64 -d > "$tmp"; '
    'chmod 600 -- "$tmp"; mv -fT -- "$tmp" "$1/$2"; '
    'logger -t fleet-gpu-clear -- "$4" || echo "fleet-gpu-clear: not in the system journal" >&2'
)


#: What to do about a record ``fleet gpu clear`` cannot use, by ``WatchState.status``.
_WAY_OUT = {
    "none": "deploy the watcher (fleet deploy) and let it begin its record",
    "no-root": "give the SSH user passwordless sudo (sudo -n), as fleet deploy needs",
    "foreign": "restart the watcher (systemctl restart fleet-gpu-watch): it moves the record aside and begins "
    "this host's own, and a GPU that throws again is quarantined again",
    "bad-record": "restart the watcher (systemctl restart fleet-gpu-watch): it moves the corrupt record aside "
    "and begins a new one, and a GPU that throws again is quarantined again",
}


def _gpu(state: WatchState, host: str, gpu: int) -> GpuWatch:
    if not state.ok:
        way = _WAY_OUT.get(state.status, "check the host (sudo cat " + DEFAULT_STATE_DIR + "/record.json)")
        raise FleetError(
            f"host {host}: the GPU watcher's record cannot be read ({state.status}: {state.error}); nothing was "
            f"cleared. Way out: {way}"
        )
    found = state.gpu(gpu)
    if found is None:
        known = ", ".join(str(g.index) for g in state.gpus if g.index is not None) or "none"
        raise ClearRefused(
            f"host {host}: GPU {gpu} is not in the watcher's record (GPUs it watches: {known}); nothing was cleared"
        )
    return found


def clear_entry(state: WatchState, host: str, gpu: int, by: str, why: str, now: float) -> tuple[dict[str, Any], str]:
    """The new ``clears.json`` and a one-line description (pure); ``FleetError`` when the GPU
    cannot be cleared (the record unreadable, no such GPU, not quarantined)."""
    found = _gpu(state, host, gpu)
    if state.clears_problem is not None:
        raise FleetError(
            f"host {host}: {state.clears_problem}: it keeps who cleared which GPU before, so fleet does not write "
            f"over it; nothing was cleared. Way out: look at it (sudo cat {DEFAULT_STATE_DIR}/{CLEARS}), move it "
            "aside, then clear again"
        )
    if found.quarantine is None:
        raise ClearRefused(
            f"host {host}: GPU {gpu} is not quarantined (no critical event since its last clear); nothing was cleared"
        )
    entry = {
        "record_id": state.record_id,
        "through_seq": state.seq,
        "by": by,
        "why": why,
        "at": now,
        "cleared": found.quarantine.describe(),
    }
    clears = dict(state.clears or {})
    gpus = dict(clears.get("gpus") or {})
    gpus[found.uuid] = [*list(gpus.get(found.uuid) or [])[-(KEEP_CLEARS - 1) :], entry]
    clears.update({"schema": 1, "gpus": gpus})
    text = f"GPU {gpu} ({found.uuid}) cleared of {found.quarantine.describe()} by {by}: {why}"
    return clears, text


def write_command(clears: dict[str, Any], text: str, state_dir: str = DEFAULT_STATE_DIR) -> str:
    data = base64.b64encode((json.dumps(clears, sort_keys=True, indent=1) + "\n").encode()).decode()
    return shlex.join(["sudo", "-n", "sh", "-c", _WRITE, "fleet-gpu-clear", state_dir, CLEARS, data, text[:900]])


def read_clear(
    target: SshTarget, gpu: int, by: str, why: str, now: float, timeout: float = 30.0
) -> tuple[dict[str, Any], str]:
    """Read the host's record and decide (:func:`clear_entry`): the new ``clears.json`` and what
    is cleared; nothing is written. ``ClearRefused`` (bad input) or ``FleetError`` (the host)."""
    try:
        _rc, out, _err = run_command(target, watch_command(), timeout)
    except SshError as exc:
        raise FleetError(f"host {target.name}: {exc}; nothing was cleared") from None
    return clear_entry(parse_watch_state(out.splitlines()), target.name, gpu, by, why, now)


def write_clear(target: SshTarget, clears: dict[str, Any], text: str, timeout: float = 30.0) -> None:
    """Write what :func:`read_clear` decided (``clears.json`` and the host's system journal);
    ``FleetError`` when the host could not be reached or written."""
    try:
        rc, out, err = run_command(target, write_command(clears, text), timeout)
    except SshError as exc:
        raise FleetError(f"host {target.name}: {exc}; nothing was cleared") from None
    if rc != 0:
        raise FleetError(f"host {target.name}: writing {CLEARS} exited {rc}: {(err or out).strip()[-300:]}")


def clear_gpu(target: SshTarget, gpu: int, by: str, why: str, now: float, timeout: float = 30.0) -> str:
    """Read the host's record, decide, write; returns what was cleared. ``FleetError`` on any
    refusal (nothing written) or when the host could not be reached or written."""
    clears, text = read_clear(target, gpu, by, why, now, timeout)
    write_clear(target, clears, text, timeout)
    return text

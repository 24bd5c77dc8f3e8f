"""Faults on demand, per host, without touching fleet's inputs (unit, flags, model).

A JSON file at ``$FLEET_LAB_FAULTS`` (default ``/etc/fleet-lab/vllm-faults.json``); a missing
or empty file means no faults. Keys (all optional)::

    {
      "fail_load": ["meta-llama/Llama-3.1-8B-Instruct", "/models/x"],
      "hang_after_load": true,
      "crash_after_seconds": 30,
      "load_seconds": 20
    }

* ``fail_load``: loading the weights fails (exit 1, a safetensors error) when the model
  argument, its resolved directory or its served name is listed.
* ``hang_after_load``: the server comes up and ``/health`` is 200, but no request ever produces
  a token (the "alive but hung" engine); requests wait until the client gives up.
* ``crash_after_seconds``: N seconds after the server is ready the engine dies: in-flight
  requests fail, ``/health`` answers 503, and the watchdog then ends the process (status 0).
* ``load_seconds``: how long loading takes (wins over ``$FLEET_LAB_LOAD_SECONDS``).

The file is read at start and re-read every second while serving, so ``hang_after_load`` and
``crash_after_seconds`` can be switched on for a running server (the crash clock starts when
the running server first sees the key).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = "/etc/fleet-lab/vllm-faults.json"


def faults_path() -> Path:
    return Path(os.environ.get("FLEET_LAB_FAULTS") or DEFAULT_PATH)


@dataclass(frozen=True)
class Faults:
    fail_load: tuple[str, ...] = ()
    hang_after_load: bool = False
    crash_after_seconds: float | None = None
    load_seconds: float | None = None
    problems: tuple[str, ...] = field(default=())

    def fails_load(self, *names: str) -> bool:
        wanted = {n.rstrip("/") for n in self.fail_load}
        return any(name.rstrip("/") in wanted for name in names if name)


def read_faults(path: Path | None = None) -> Faults:
    """The faults in force now; a malformed file is reported in ``problems`` and ignored."""
    path = path or faults_path()
    try:
        text = path.read_text()
    except OSError:
        return Faults()
    if not text.strip():
        return Faults()
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        fail_load = data.get("fail_load") or []
        if isinstance(fail_load, str):
            fail_load = [fail_load]
        crash = data.get("crash_after_seconds")
        load = data.get("load_seconds")
        return Faults(
            fail_load=tuple(str(x) for x in fail_load),
            hang_after_load=bool(data.get("hang_after_load", False)),
            crash_after_seconds=float(crash) if crash is not None else None,
            load_seconds=float(load) if load is not None else None,
        )
    except (ValueError, TypeError) as exc:
        return Faults(problems=(f"{path}: {exc}",))

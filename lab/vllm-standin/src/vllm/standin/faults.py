"""Faults on demand, per host, without touching fleet's inputs (unit, flags, model).

A JSON file at ``$FLEET_LAB_FAULTS`` (default ``/etc/fleet-lab/vllm-faults.json``); a missing
or empty file means no faults. Keys (all optional)::

    {
      "fail_load": ["meta-llama/Llama-3.1-8B-Instruct", "/models/x"],
      "hang_after_load": true,
      "crash_after_seconds": 30,
      "stall_after_seconds": 5, "stall_seconds": 2, "stall_every_seconds": 30,
      "load_seconds": 20,
      "unknown_flags": ["--no-enable-prefix-caching"],
      "sigterm_while_loading": "deadlock",
      "drain_open_streams": "hang"
    }

* ``fail_load``: loading the weights fails (exit 1, a safetensors error) when the model
  argument, its resolved directory or its served name is listed.
* ``hang_after_load``: the server comes up and ``/health`` is 200, but no request ever produces
  a token (the "alive but hung" engine); requests wait until the client gives up.
* ``crash_after_seconds``: N seconds after the server is ready the engine dies: in-flight
  requests fail, ``/health`` answers 503, and the watchdog then ends the process (status 0).
* ``stall_after_seconds`` / ``stall_seconds`` / ``stall_every_seconds``: N seconds after the
  server is ready the engine stops producing tokens for ``stall_seconds``, then goes on as if
  nothing happened; with ``stall_every_seconds`` the stall comes back that often (counted from
  the start of one stall to the start of the next). ``/health`` stays 200 and requests wait
  (those whose client gives up stay counted in ``vllm:num_requests_running``). This is the
  half-alive server that a ping-style health check does not see: the engine's steps stall for a
  while and recover (Ray Serve issue ray-project/ray#61263, "Health check does not detect
  request-serving stalls"; vLLM's ``/health`` only asks whether the engine core is alive,
  ``vllm/entrypoints/serve/instrumentator/health.py``). A gate that probes with a real
  completion sees it go red and green again: the flap that must reset a soak.
* ``load_seconds``: how long loading takes (wins over ``$FLEET_LAB_LOAD_SECONDS``).
* ``unknown_flags``: options this host's vLLM does not know, as a build or release whose parser
  differs from the one fleet planned for: the whole argument behind any of the listed spellings
  (``--no-enable-prefix-caching`` takes ``--enable-prefix-caching`` with it) is left out of
  ``vllm serve``'s parser and of ``make_arg_parser``, so both refuse it the way vLLM refuses a
  flag it does not have (``unrecognized arguments``). Read when a parser is built.
* ``sigterm_while_loading``: which of the real engine's three outcomes a SIGTERM that arrives
  while the server starts takes: ``killed`` (the process dies by SIGTERM), ``deadlock`` (it never
  listens and never exits; only SIGKILL ends it, and its engine core with it under a unit's
  ``KillMode``), ``ignored`` (it loads and serves). Without the key: ``killed`` before the engine
  core is spawned, ``ignored`` after, as measured on the real engine.
* ``drain_open_streams``: what streams still open at the ``--shutdown-timeout`` deadline get:
  ``error`` (default: an SSE error event and ``[DONE]``; the server exits 0) or ``hang``
  (nothing more; the server stops listening but never exits, as uvicorn waits for open
  connections with no limit).

The file is read at start and re-read every second while serving, so ``hang_after_load`` and
``crash_after_seconds`` can be switched on for a running server (the crash clock starts when
the running server first sees the key; so does the stall clock).
"""

from __future__ import annotations

import argparse
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
    stall_after_seconds: float | None = None
    stall_seconds: float = 0.0
    stall_every_seconds: float | None = None
    unknown_flags: frozenset[str] = frozenset()
    #: what a SIGTERM during start-up does: one of ``SIGTERM_WHILE_LOADING`` (None: by timing)
    sigterm_while_loading: str | None = None
    #: what streams still open at the drain deadline do: one of ``DRAIN_OPEN_STREAMS``
    drain_open_streams: str = "error"
    problems: tuple[str, ...] = field(default=())

    def fails_load(self, *names: str) -> bool:
        wanted = {n.rstrip("/") for n in self.fail_load}
        return any(name.rstrip("/") in wanted for name in names if name)

    def stalled(self, elapsed: float) -> bool:
        """Whether the engine is in a stall ``elapsed`` seconds after the stall clock started
        (the server became ready, or first saw the key)."""
        if self.stall_after_seconds is None or self.stall_seconds <= 0:
            return False
        into = elapsed - self.stall_after_seconds
        if into < 0:
            return False
        if self.stall_every_seconds is not None:
            into %= self.stall_every_seconds
        return into < self.stall_seconds


#: The three ways vLLM takes a SIGTERM that arrives while it starts (measured on the real engine,
#: ``docs/real-engine.md``): ``killed`` (the default action ends the process: it came before
#: ``run_server`` installed ``_interrupt_init``), ``deadlock`` (the ``KeyboardInterrupt`` is
#: swallowed while the engine core is spawned: the API server waits in the engine handshake and
#: the engine core for it, ``HANDSHAKE_TIMEOUT_MINS`` = 5 in ``vllm/v1/engine/core.py``; neither
#: exits), ``ignored`` (the server loads and serves as if no signal came).
SIGTERM_WHILE_LOADING = ("killed", "deadlock", "ignored")
#: The two ways streams still open at the ``--shutdown-timeout`` deadline end (measured):
#: ``error`` (each gets an SSE ``{"error": ...}`` event and ``[DONE]``, the server exits 0) or
#: ``hang`` (they get neither and uvicorn's ``Server.shutdown`` waits for their connections with no
#: limit: the API server never exits; under systemd, SIGKILL after ``TimeoutStopSec``).
DRAIN_OPEN_STREAMS = ("error", "hang")


def _choice(data: dict[str, object], key: str, allowed: tuple[str, ...]) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if value not in allowed:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


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
        stall_after = _seconds(data, "stall_after_seconds")
        stall = _seconds(data, "stall_seconds") or 0.0
        every = _seconds(data, "stall_every_seconds")
        if every is not None and every <= stall:
            raise ValueError(f"stall_every_seconds ({every:g}) must be more than stall_seconds ({stall:g})")
        unknown = data.get("unknown_flags") or []
        if isinstance(unknown, str):
            unknown = [unknown]
        return Faults(
            fail_load=tuple(str(x) for x in fail_load),
            hang_after_load=bool(data.get("hang_after_load", False)),
            crash_after_seconds=float(crash) if crash is not None else None,
            load_seconds=float(load) if load is not None else None,
            stall_after_seconds=stall_after,
            stall_seconds=stall,
            stall_every_seconds=every,
            unknown_flags=frozenset(str(x) for x in unknown),
            sigterm_while_loading=_choice(data, "sigterm_while_loading", SIGTERM_WHILE_LOADING),
            drain_open_streams=_choice(data, "drain_open_streams", DRAIN_OPEN_STREAMS) or "error",
        )
    except (ValueError, TypeError) as exc:
        return Faults(problems=(f"{path}: {exc}",))


def _seconds(data: dict[str, object], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key}: {value!r} is not a number of seconds >= 0")
    return float(value)


def drop_unknown_flags(
    parser: argparse.ArgumentParser, unknown: frozenset[str] | None = None
) -> argparse.ArgumentParser:
    """Remove from ``parser`` every argument with a spelling in ``unknown`` (default: the
    ``unknown_flags`` fault in force); returns the parser."""
    unknown = read_faults().unknown_flags if unknown is None else unknown
    if not unknown:
        return parser
    for action in list(parser._actions):
        if unknown & set(action.option_strings):
            parser._remove_action(action)
            for spelling in action.option_strings:
                parser._option_string_actions.pop(spelling, None)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
    return parser

"""Alert thresholds per host, from the inventory's ``alerts`` entry (host data beats group data).

Every key is optional; a missing key takes the default below. Bad values are all reported at once,
naming the file, the host, the field, the value and what is allowed, before anything is written::

    alerts = {
        "kv_cache_usage": 0.9,          # fraction 0..1 of the KV cache in use ...
        "kv_cache_for": "10m",          # ... for this long
        "waiting_requests": 20,         # requests queued ...
        "waiting_for": "5m",            # ... for this long
        "preemption_ratio": 0.02,       # preemptions per finished request over preemption_window
        "preemption_window": "10m",
        "preemption_for": "5m",
        "e2e_p99_seconds": 60.0,        # p99 end-to-end latency over latency_window ...
        "ttft_p99_seconds": 5.0,        # p99 time to first token over latency_window ...
        "latency_window": "5m",
        "latency_for": "5m",            # ... for this long
        "instance_down_for": "2m",      # scrape failing (or /metrics gone) this long
        "restarts": 3,                  # more unit restarts than this within restart_window
        "restart_window": "30m",
        "for": None,                    # optional: one `for:` for every alert (tests, rehearsals)
    }

Durations are Prometheus durations (``30s``, ``5m``, ``1h30m``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from fleet.errors import FieldProblem

#: Prometheus' duration syntax (``model.ParseDuration``): units from largest to smallest.
_DURATION_RE = re.compile(r"^(?:\d+y)?(?:\d+w)?(?:\d+d)?(?:\d+h)?(?:\d+m)?(?:\d+s)?(?:\d+ms)?$")
_UNIT_SECONDS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration (``1h30m`` → 5400)."""
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in re.findall(r"(\d+)(ms|y|w|d|h|m|s)", text))


def is_duration(value: object) -> bool:
    return isinstance(value, str) and value != "" and bool(_DURATION_RE.match(value)) and duration_seconds(value) > 0


@dataclass(frozen=True)
class Thresholds:
    """The numbers behind one host's alerts (defaults: a conservative chat-serving fleet)."""

    kv_cache_usage: float = 0.9
    kv_cache_for: str = "10m"
    waiting_requests: int = 20
    waiting_for: str = "5m"
    preemption_ratio: float = 0.02
    preemption_window: str = "10m"
    e2e_p99_seconds: float = 60.0
    ttft_p99_seconds: float = 5.0
    latency_window: str = "5m"
    latency_for: str = "5m"
    instance_down_for: str = "2m"
    restarts: int = 3
    restart_window: str = "30m"
    preemption_for: str = "5m"


KEYS: tuple[str, ...] = (*(f.name for f in fields(Thresholds)), "for")

_FRACTIONS = ("kv_cache_usage", "preemption_ratio")
_COUNTS = ("waiting_requests", "restarts")
_SECONDS = ("e2e_p99_seconds", "ttft_p99_seconds")
_DURATIONS = tuple(f.name for f in fields(Thresholds) if f.name.endswith(("_for", "_window")))


def parse_thresholds(inventory: str, host: str, raw: Any) -> tuple[Thresholds, list[FieldProblem]]:
    """The host's thresholds and every problem with its ``alerts`` entry (pure)."""
    problems: list[FieldProblem] = []

    def problem(key: str, value: object, allowed: str) -> None:
        problems.append(FieldProblem(inventory, host, f"alerts.{key}", value, allowed))

    if raw is None:
        return Thresholds(), problems
    if not isinstance(raw, Mapping):
        problems.append(FieldProblem(inventory, host, "alerts", raw, "a dict with keys " + ", ".join(KEYS)))
        return Thresholds(), problems
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in KEYS:
            problem(str(key), value, "unknown key; allowed: " + ", ".join(KEYS))
        elif key in _FRACTIONS:
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                problem(key, value, "a fraction in (0, 1], e.g. 0.9")
            else:
                values[key] = float(value)
        elif key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problem(key, value, "a whole number >= 0")
            else:
                values[key] = value
        elif key in _SECONDS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problem(key, value, "a number of seconds > 0")
            else:
                values[key] = float(value)
        elif key == "for" and value is None:
            continue
        elif not is_duration(value):
            problem(key, value, "a Prometheus duration like 30s, 5m, 1h30m")
        elif key == "for":
            values.update(dict.fromkeys((d for d in _DURATIONS if d.endswith("_for")), value))
        else:
            values[key] = value
    # An explicit per-alert duration beats the blanket "for".
    explicit = {k: v for k, v in values.items() if k in raw}
    return replace(Thresholds(), **{**values, **explicit}), problems

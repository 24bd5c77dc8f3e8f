"""The one reader of ``systemctl show`` output (pure), for every fact and executor that asks systemd.

``systemctl show -p A,B UNIT...`` prints one ``Name=value`` line per property, units separated by
an empty line; the value is everything after the first ``=`` (it may hold ``=`` itself, e.g.
``ExecStart={ path=... }``) and is empty when unset (systemctl(1) "show"; property names and
meanings: org.freedesktop.systemd1(5) "Properties"). Numbers are decimal (``MainPID=0`` when there
is no main process). Timestamps are ``@<seconds>`` with ``--timestamp=unix`` (systemd >= 248),
otherwise local text (``Sun 2026-11-22 21:00:00 UTC``) that is not parsed here; their
``...Monotonic`` twins are microseconds of CLOCK_MONOTONIC, ``0`` when the event never happened.

* :func:`show_blocks`: the properties of each unit, in order;
* :func:`shown_unit`: the properties fleet reads, typed (:class:`ShownUnit`);
* :func:`started_unix`: when an event (``ActiveEnter``, ``ExecMainStart``) happened, in the host's
  wall-clock seconds, from the unix timestamp or, on older systemd, its monotonic twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The states in which a unit counts as up (``systemctl is-active`` answers 0 for these).
ACTIVE_STATES = ("active", "reloading")


def show_blocks(lines: Iterable[str]) -> list[dict[str, str]]:
    """``Name=value`` lines into one dict per unit (blocks separated by empty lines).

    Lines without ``=`` are ignored; a property repeated within a block keeps its last value.
    """
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        name, sep, value = line.partition("=")
        if sep and name and name.isidentifier():
            current[name] = value
    if current:
        blocks.append(current)
    return blocks


def show_properties(text: str | Iterable[str]) -> dict[str, str]:
    """The properties of one unit's ``systemctl show`` output (the first block; empty if none)."""
    blocks = show_blocks(text.splitlines() if isinstance(text, str) else text)
    return blocks[0] if blocks else {}


def show_int(value: str | None) -> int | None:
    """A decimal property (``MainPID``, ``NRestarts``); None for empty, ``[not set]`` or text."""
    if value is None:
        return None
    text = value.strip()
    return int(text) if text.isdigit() else None


def show_unix(value: str | None) -> float | None:
    """``@1790000000`` (``--timestamp=unix``) -> seconds; empty, ``n/a`` or another format -> None."""
    if value and value.startswith("@"):
        try:
            return float(value[1:])
        except ValueError:
            return None
    return None


def started_unix(
    props: Mapping[str, str], event: str, now_unix: float | None = None, now_monotonic: float | None = None
) -> float | None:
    """When ``event`` (``ActiveEnter``, ``ExecMainStart``...) happened, in the host's unix seconds.

    ``<event>Timestamp`` when it is a unix timestamp; else ``<event>TimestampMonotonic`` placed on
    the wall clock with the host's clocks read at the same moment (``now_unix``, ``now_monotonic``
    in seconds). None when the event never happened (monotonic ``0``) or cannot be placed.
    """
    at = show_unix(props.get(f"{event}Timestamp"))
    if at is not None:
        return at
    mono = show_int(props.get(f"{event}TimestampMonotonic"))
    if mono and now_unix is not None and now_monotonic is not None:
        return now_unix - (now_monotonic - mono / 1e6)
    return None


@dataclass(frozen=True)
class ShownUnit:
    """The properties of one unit that fleet reads, typed; ``props`` keeps them all."""

    id: str | None
    load_state: str | None
    active_state: str | None
    sub_state: str | None
    n_restarts: int | None
    main_pid: int | None  #: None when there is no main process (``MainPID=0``)
    props: Mapping[str, str]

    @property
    def active(self) -> bool:
        return self.active_state in ACTIVE_STATES


def shown_unit(props: Mapping[str, str]) -> ShownUnit | None:
    """One block of ``systemctl show`` typed; None when it does not even say the unit's state."""
    if "ActiveState" not in props and "Id" not in props:
        return None
    return ShownUnit(
        id=props.get("Id") or None,
        load_state=props.get("LoadState") or None,
        active_state=props.get("ActiveState", "").strip() or None,
        sub_state=props.get("SubState", "").strip() or None,
        n_restarts=show_int(props.get("NRestarts")),
        main_pid=show_int(props.get("MainPID")) or None,
        props=dict(props),
    )

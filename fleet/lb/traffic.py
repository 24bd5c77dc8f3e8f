"""Which balancer server each instance is, and taking instances out of traffic and back.

``Traffic`` maps an instance (``host``, ``vllm-N``) to its seat: the balancer (one per admin
socket, shared by every instance behind it), the backend and the server name
(``fleet.lb.config.server_name``). It reads each balancer's state with one command line for all
its servers (``fleet.lb.runtime.SNAPSHOT_COMMAND``), reused for ``fresh_s`` so a rollout tick that
observes every instance of a batch asks each balancer once.

``retire`` takes servers a new configuration drops (a host removed from the inventory) out the
same way before ``fleet deploy`` reloads without them, then leaves them in ``maint``.

``preflight`` is what a rollout checks before anything is touched: every balancer answers
(``BalancerDown`` otherwise: exit 1) and has every server fleet will steer
(``BalancerMisconfigured`` otherwise, listing them: exit 2). ``take_out``/``put_back`` are the
drain outside the rolling engine (a reboot for a driver change, ``fleet drain``): ``drain`` in
HAProxy, then wait until the balancer reports no session or queued request on the servers, bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleet.facts.runner import SshTarget
from fleet.inventory.spec import BalancerSpec, HostSpec, LoadedInventory
from fleet.lb.config import server_name
from fleet.lb.runtime import (
    SNAPSHOT_COMMAND,
    AdminState,
    AnswerError,
    ServerState,
    ServerView,
    check_set_answer,
    parse_servers_state,
    parse_snapshot,
    set_state_command,
    split_answers,
)
from fleet.lb.transport import BalancerDown, BalancerError, BalancerMisconfigured, LocalSocket, SshSocket, Transport

#: A snapshot read this recently is reused (one read per balancer per rollout tick).
FRESH_S = 0.5


class Balancer:
    """One HAProxy: its transport and its last snapshot (safe to use from several threads)."""

    def __init__(self, spec: BalancerSpec, transport: Transport, fresh_s: float = FRESH_S) -> None:
        self.spec = spec
        self.transport = transport
        self.fresh_s = fresh_s
        self._lock = threading.Lock()
        self._snap: tuple[float, dict[tuple[str, str], ServerView]] | None = None

    @property
    def name(self) -> str:
        return self.transport.name

    def snapshot(self, fresh: bool = False) -> dict[tuple[str, str], ServerView]:
        with self._lock:
            if not fresh and self._snap is not None and time.monotonic() - self._snap[0] < self.fresh_s:
                return self._snap[1]
            text = self.transport.send(SNAPSHOT_COMMAND)
            try:
                views = parse_snapshot(text)
            except AnswerError as exc:
                raise BalancerMisconfigured(f"{self.name}: {exc}") from None
            self._snap = (time.monotonic(), views)
            return views

    def view(self, backend: str, server: str) -> ServerView:
        found = self.snapshot().get((backend, server))
        if found is None:
            raise BalancerMisconfigured(
                f"{self.name} has no server {backend}/{server}: install fleet's configuration on it "
                f"(`fleet deploy`, or `fleet lb export` and reload)"
            )
        return found

    def servers_state(self) -> list[ServerState]:
        """``show servers state``: every server HAProxy has now, with its address and port."""
        try:
            return parse_servers_state(split_answers(self.transport.send("show servers state"), 1)[0])
        except AnswerError as exc:
            raise BalancerMisconfigured(f"{self.name}: {exc}") from None

    def set_state(self, backend: str, server: str, state: AdminState) -> None:
        command = set_state_command(backend, server, state)
        answer = self.transport.send(command)
        with self._lock:
            self._snap = None
        try:
            check_set_answer(command, answer)
        except AnswerError as exc:
            raise BalancerMisconfigured(f"{self.name}: {exc}") from None

    def close(self) -> None:
        self.transport.close()


@dataclass(frozen=True)
class Seat:
    """Where one instance sits in a balancer."""

    balancer: Balancer
    backend: str
    server: str

    def describe(self) -> str:
        return f"{self.backend}/{self.server} on {self.balancer.name}"

    def ready_command(self) -> str:
        """What puts it back into traffic by hand, when fleet cannot."""
        line = set_state_command(self.backend, self.server, AdminState.READY)
        sock = self.balancer.spec.admin_socket
        where = "" if self.balancer.spec.local else f"on host {self.balancer.spec.on}: "
        return f"{where}echo '{line}' | sudo socat stdio UNIX-CONNECT:{sock}"


class Traffic:
    """Instances → seats, for every instance whose host has a balancer."""

    def __init__(self, seats: Mapping[tuple[str, str], Seat]) -> None:
        self.seats = dict(seats)

    def __bool__(self) -> bool:
        return bool(self.seats)

    def seat(self, host: str, instance: str) -> Seat | None:
        return self.seats.get((host, instance))

    @property
    def balancers(self) -> list[Balancer]:
        seen: dict[int, Balancer] = {}
        for s in self.seats.values():
            seen.setdefault(id(s.balancer), s.balancer)
        return list(seen.values())

    def view(self, host: str, instance: str) -> ServerView | None:
        seat = self.seat(host, instance)
        return None if seat is None else seat.balancer.view(seat.backend, seat.server)

    def set_state(self, host: str, instance: str, state: AdminState) -> None:
        seat = self.seat(host, instance)
        if seat is not None:
            seat.balancer.set_state(seat.backend, seat.server, state)

    def preflight(self) -> None:
        """Every balancer answers and has every server (see the module docstring)."""
        down: list[str] = []
        wrong: list[str] = []
        for b in self.balancers:
            try:
                views = b.snapshot(fresh=True)
            except BalancerDown as exc:
                down.append(str(exc))
                continue
            except BalancerMisconfigured as exc:
                wrong.append(str(exc))
                continue
            missing = [f"{s.backend}/{s.server}" for s in self.seats.values()
                       if s.balancer is b and (s.backend, s.server) not in views]  # fmt: skip
            if missing:
                wrong.append(
                    f"{b.name} has no server {', '.join(missing)}: install fleet's configuration on it "
                    "(`fleet deploy`, or `fleet lb export` and reload)"
                )
        if wrong:
            raise BalancerMisconfigured("\n".join(wrong + down))
        if down:
            raise BalancerDown("\n".join(down))

    def close(self) -> None:
        for b in self.balancers:
            b.close()


def balancer_of(spec: HostSpec, served: str | None) -> BalancerSpec | None:
    """The balancer in front of an instance serving ``served`` on the host of ``spec``: the host's,
    or on a host with ``models`` the entry's that serves that name (None: no such entry)."""
    if not spec.models:
        return spec.balancer
    return next((m.balancer for m in spec.model_specs if (m.served_model_name or m.model) == served), None)


def traffic_of(
    loaded: LoadedInventory,
    instances: Iterable[tuple[str, str]],
    transports: Callable[[BalancerSpec, SshTarget | None], Transport] | None = None,
    served: Mapping[tuple[str, str], str] | None = None,
) -> Traffic:
    """The seats of ``instances`` ((host, "vllm-N")) whose hosts have a balancer entry.

    ``served``: (host, instance) -> the model name the instance serves, which picks the entry (and
    so the balancer and backend) of a host with ``models`` (``fleet.plan.models``); an instance of
    such a host without its name has no seat."""
    make = transports or default_transport
    targets = {b.name: b for b in loaded.balancer_hosts}
    balancers: dict[tuple[str, str], Balancer] = {}
    seats: dict[tuple[str, str], Seat] = {}
    specs = {s.name: s for s in loaded.hosts}
    names = served or {}
    for host, instance in instances:
        spec = balancer_of(specs[host], names.get((host, instance))) if host in specs else None
        if spec is None:
            continue
        if spec.key not in balancers:
            target = None
            if not spec.local:
                if spec.on not in targets:  # checked at load; a --limit cannot hide it
                    raise BalancerMisconfigured(f"balancer host {spec.on} is not in {loaded.path}")
                data = loaded.pyinfra.get_host(spec.on).data.dict()  # type: ignore[no-untyped-call]
                target = SshTarget.from_data(spec.on, data)
            balancers[spec.key] = Balancer(spec, make(spec, target))
        seats[(host, instance)] = Seat(balancers[spec.key], spec.backend, server_name(host, instance))
    return Traffic(seats)


def default_transport(spec: BalancerSpec, target: SshTarget | None) -> Transport:
    if target is None:
        return LocalSocket(spec.admin_socket, spec.timeout_s)
    return SshSocket(target, spec.admin_socket, spec.timeout_s)


# ---- out of traffic and back, outside the engine (reboots, fleet drain) ---------------------------


def take_out(
    traffic: Traffic,
    members: Sequence[tuple[str, str]],
    timeout_s: float,
    *,
    progress: Callable[[str], None] = lambda _m: None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """``drain`` the members' servers and wait until none has a session or a queued request, for
    up to ``timeout_s``; returns what was still busy then (empty: drained). Raises ``BalancerError``."""
    seats = [(f"{m[0]}/{m[1]}", seat) for m in members if (seat := traffic.seat(*m)) is not None]
    for _name, seat in seats:
        seat.balancer.set_state(seat.backend, seat.server, AdminState.DRAIN)
    return _wait_idle(seats, timeout_s, progress, sleep, clock)


def _wait_idle(
    seats: Sequence[tuple[str, Seat]],
    timeout_s: float,
    progress: Callable[[str], None],
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> list[str]:
    """Until no seat has a session or a queued request (``[]``), or what is still busy at the deadline."""
    deadline = clock() + timeout_s
    while True:
        busy = []
        for name, seat in seats:
            v = seat.balancer.snapshot(fresh=True).get((seat.backend, seat.server))
            if v is not None and v.busy:
                busy.append(f"{name}: {v.describe()}")
        if not busy:
            return []
        if clock() >= deadline:
            return busy
        progress("waiting for the balancer to finish: " + "; ".join(busy))
        sleep(0.5)


def retire(
    balancer: Balancer,
    servers: Sequence[tuple[str, str]],
    timeout_s: float,
    *,
    progress: Callable[[str], None] = lambda _m: None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Servers a new configuration drops, taken out first: ``drain``, wait (bounded) until they
    have no session or queued request, then ``maint``; returns what was still busy at the deadline.
    Raises ``BalancerError``."""
    seats = [(f"{b}/{s}", Seat(balancer, b, s)) for b, s in servers]
    for _name, seat in seats:
        balancer.set_state(seat.backend, seat.server, AdminState.DRAIN)
    busy = _wait_idle(seats, timeout_s, progress, sleep, clock)
    for _name, seat in seats:
        balancer.set_state(seat.backend, seat.server, AdminState.MAINT)
    return busy


def put_back(traffic: Traffic, members: Sequence[tuple[str, str]]) -> None:
    """``ready`` again (after the members pass their health checks)."""
    for m in members:
        traffic.set_state(*m, AdminState.READY)


__all__ = [
    "Balancer",
    "BalancerDown",
    "BalancerError",
    "BalancerMisconfigured",
    "Seat",
    "Traffic",
    "put_back",
    "retire",
    "take_out",
    "traffic_of",
]

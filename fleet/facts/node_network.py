"""What one node of a multi-node instance sees towards its leader, as a pyinfra fact (read-only).

``NodeNetwork`` sends ``fleet/facts/node_network_probe.py`` to the host's ``python3 -I`` on stdin
(as the login user: nothing it reads needs root, nothing is written) with the leader's address,
the rendezvous port (0 on the leader itself: it does not dial itself) and the connect timeout,
and validates its one JSON line into :class:`NodeNet`: the outcome of one TCP connect to the
leader's ``--master-addr``/``--master-port``, the route towards the leader (interface, MTU) and
the host's RDMA ports (``/sys/class/infiniband``). How the connect's outcomes are told apart, and
why a refused connection counts as reachable, is in the probe's docstring. A host without
python3 answers ``no-python``: the audit says so instead of guessing.

**Example:**

.. code:: python

    net = host.get_fact(NodeNetwork, address="10.0.0.1", port=29501, timeout=3.0)
    net.connect.reachable if net.connect else None
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.facts.output import answer_object

STATUSES = ("ok", "no-python", "probe-crashed", "bad-output")
#: What a connect may end in (``node_network_probe.connect``); the first two mean the path works.
OUTCOMES = ("open", "refused", "timeout", "unreachable", "unresolved", "error")
REACHABLE = frozenset({"open", "refused"})
#: An RDMA port's state when it carries traffic (``/sys/class/infiniband/*/ports/*/state``: ``4: ACTIVE``).
ACTIVE = "ACTIVE"
DEFAULT_CONNECT_TIMEOUT = 3.0
_END = "FLEET_NODE_NETWORK_EOF"


@dataclass(frozen=True)
class Connect:
    """One TCP connect to the leader's rendezvous."""

    port: int
    outcome: str  #: one of :data:`OUTCOMES`
    errno: int | None
    error: str
    seconds: float

    @property
    def reachable(self) -> bool:
        """Whether the path to the leader's port works: connected, or refused by its kernel."""
        return self.outcome in REACHABLE


@dataclass(frozen=True)
class Route:
    """The route towards the leader: interface, source address, and the MTU that applies."""

    dev: str | None
    src: str | None
    kind: str | None  #: ``unicast``, ``local`` (the leader itself), ...
    mtu: int | None  #: the interface's (``/sys/class/net/IF/mtu``)
    route_mtu: int | None  #: the route's own ``mtu`` metric, when it has one
    error: str | None

    @property
    def effective_mtu(self) -> int | None:
        """What packets towards the leader are limited to: the route's MTU, else the interface's."""
        return self.route_mtu if self.route_mtu is not None else self.mtu


@dataclass(frozen=True)
class RdmaPort:
    device: str  #: ``mlx5_0``
    port: int
    state: str  #: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``, ... (the word after ``4: ``), ``?`` unread
    link_layer: str  #: ``InfiniBand`` or ``Ethernet`` (RoCE), ``?`` unread
    rate: str  #: ``200 Gb/sec (4X HDR)``, or empty

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    def describe(self) -> str:
        return f"{self.device} port {self.port} {self.state} ({self.link_layer}{', ' + self.rate if self.rate else ''})"


@dataclass(frozen=True)
class NodeNet:
    status: str  #: one of :data:`STATUSES`
    error: str | None
    address: str  #: the leader's address as the plan names it
    resolved: str | None  #: that address, numeric, as this host resolves it
    connect: Connect | None  #: None on the leader (not asked), or when the probe did not run
    route: Route | None
    rdma_present: bool  #: ``/sys/class/infiniband`` has devices
    rdma: tuple[RdmaPort, ...]
    rdma_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def active_rdma(self) -> tuple[RdmaPort, ...]:
        return tuple(p for p in self.rdma if p.active)


@cache
def probe_script() -> str:
    return resources.files("fleet.facts").joinpath("node_network_probe.py").read_text()


def node_network_command(address: str, port: int, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> str:
    """The probe on the host's python3 with its arguments; always exits 0."""
    no_python = shlex.quote(json.dumps({"schema": 1, "status": "no-python", "error": "no python3 on the host"}))
    args = " ".join(shlex.quote(str(a)) for a in (address, int(port), float(timeout)))
    return (
        f"if ! command -v python3 >/dev/null 2>&1; then printf '%s\\n' {no_python}; exit 0; fi; "
        f"python3 -I - {args} <<'{_END}'\n{probe_script()}{_END}\n"
    )


def _bad(why: str, address: str = "") -> NodeNet:
    return NodeNet("bad-output", why[:300], address, None, None, None, False, ())


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a number")
    return value


def _opt_str(value: Any, limit: int = 300) -> str | None:
    return None if value is None else str(value)[:limit]


def _state(text: Any) -> str:
    """``4: ACTIVE`` -> ``ACTIVE`` (the kernel prints the number and the name)."""
    if not isinstance(text, str) or not text.strip():
        return "?"
    return text.partition(":")[2].strip() if ":" in text else text.strip()


def parse_node_network(lines: Sequence[str]) -> NodeNet:
    """The probe's output (its JSON is the last non-empty line) -> :class:`NodeNet` (pure)."""
    raw = answer_object(lines, STATUSES)
    if isinstance(raw, str):
        return _bad(raw)
    address = str(raw.get("address") or "")
    if raw["status"] != "ok":
        return NodeNet(raw["status"], _opt_str(raw.get("error")), address, None, None, None, False, ())
    try:
        c = raw.get("connect")
        connect = None
        if c is not None:
            if not isinstance(c, dict) or c.get("outcome") not in OUTCOMES:
                raise ValueError(f"connect {c!r}")
            connect = Connect(int(c["port"]), str(c["outcome"]), _opt_int(c.get("errno")),
                              str(c.get("error") or "")[:200], float(c.get("seconds") or 0.0))  # fmt: skip
        r = raw.get("route")
        route = None
        if r is not None:
            if not isinstance(r, dict):
                raise ValueError(f"route {r!r}")
            route = Route(_opt_str(r.get("dev"), 64), _opt_str(r.get("src"), 64), _opt_str(r.get("type"), 32),
                          _opt_int(r.get("mtu")), _opt_int(r.get("route_mtu")), _opt_str(r.get("error")))  # fmt: skip
        d = raw.get("rdma") or {}
        if not isinstance(d, dict) or not isinstance(d.get("ports") or [], list):
            raise ValueError(f"rdma {d!r}")
        ports = []
        for p in d.get("ports") or []:
            if not isinstance(p, dict):
                raise ValueError(f"rdma port {p!r}")
            ports.append(RdmaPort(str(p.get("device"))[:64], int(p.get("port") or 0), _state(p.get("state")),
                                  str(p.get("link_layer") or "?")[:32], str(p.get("rate") or "")[:64]))  # fmt: skip
    except (ValueError, TypeError, KeyError) as exc:
        return _bad(f"unexpected answer ({exc})", address)
    return NodeNet("ok", None, address, _opt_str(raw.get("resolved"), 64), connect, route,
                   bool(d.get("present")), tuple(ports), _opt_str(d.get("error")))  # fmt: skip


class NodeNetwork(FactBase[NodeNet]):
    """
    Towards a multi-node instance's leader: one TCP connect to its rendezvous port (``port`` 0:
    none), the route and its MTU, and the host's RDMA ports. Changes nothing.
    """

    @override
    def command(self, address: str, port: int, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> str:
        return node_network_command(address, port, timeout)

    @override
    def process(self, output: list[str]) -> NodeNet:
        return parse_node_network(output)

"""Port collisions across hosts: who listens where, and which listeners overlap.

A host's vLLM instance *n* listens on ``port + n``; its sshd on ``ssh_port``. Before planning
the number of instances is not known, so ``spec_port_problems`` checks the declared range
(``port`` .. ``port + gpu.count - 1``: one instance per GPU at most); once planned,
``plan_port_problems`` checks the ports the instances really got.

Two listeners collide when their port ranges overlap and they can bind the same address:

* on the same machine (same ``ssh_hostname``, or host name when there is none) when either
  binds every address (no ``bind_address``, ``0.0.0.0``, ``::``) or both bind the same one;
  sshd counts as binding every address;
* on different machines only when both name the same non-loopback address (an address belongs
  to one machine; loopback addresses exist on each).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet.errors import FieldProblem


class _Gpus(Protocol):
    @property
    def count(self) -> int: ...


class HostSpec(Protocol):
    """What the port checks read of a host (``fleet.inventory.spec.HostSpec``, which imports this
    module: a protocol here, not an import back)."""

    @property
    def name(self) -> str: ...
    @property
    def machine(self) -> str: ...
    @property
    def bind_address(self) -> str | None: ...
    @property
    def port(self) -> int: ...
    @property
    def ssh_port(self) -> int: ...
    @property
    def gpu(self) -> _Gpus | None: ...
    def source_of(self, fld: str) -> str: ...


@dataclass(frozen=True)
class Listener:
    """Ports one host listens on, on one address (None: every address)."""

    host: str
    file: str
    machine: str
    address: str | None
    first: int
    last: int
    what: str  #: "vLLM" or "ssh"
    field: str  #: the inventory field that sets it

    def describe(self) -> str:
        ports = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        on = self.address or "every address"
        return f"{self.what} port {ports} on {on} of {self.machine}"


def _wildcard(address: str | None) -> bool:
    return address is None or ipaddress.ip_address(address).is_unspecified


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _shared(a: Listener, b: Listener) -> bool:
    if a.machine == b.machine:
        return _wildcard(a.address) or _wildcard(b.address) or a.address == b.address
    return a.address is not None and a.address == b.address and not _wildcard(a.address) and not _loopback(a.address)


def _candidate_pairs(listeners: Sequence[Listener]) -> list[tuple[int, int]]:
    """Pairs that can share an address at all: same machine, or same address (linear in hosts)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, listener in enumerate(listeners):
        groups.setdefault(("machine", listener.machine), []).append(i)
        if listener.address is not None and not _wildcard(listener.address) and not _loopback(listener.address):
            groups.setdefault(("address", listener.address), []).append(i)  # one machine's, wherever named
    pairs = {(i, j) for members in groups.values() for n, i in enumerate(members) for j in members[n + 1 :]}
    return sorted(pairs)


def collisions(listeners: Sequence[Listener]) -> list[FieldProblem]:
    """One problem per pair of listeners that cannot both bind, on the first of the pair."""
    problems = []
    for i, j in _candidate_pairs(listeners):
        a, b = listeners[i], listeners[j]
        if (a.host == b.host and a.what == b.what) or a.what == b.what == "ssh":
            continue  # a host's own instances; one sshd serves every host on a machine
        if a.first <= b.last and b.first <= a.last and _shared(a, b):
            other = "its own" if a.host == b.host else f"host {b.host}'s ({b.file})"
            problems.append(
                FieldProblem(
                    a.file,
                    a.host,
                    a.field,
                    a.first,
                    f"{a.describe()} collides with {other} {b.describe()}; give each listener its own ports "
                    "(instance n of a host listens on port + n)",
                )
            )
    return problems


def _vllm(spec: HostSpec, first: int, last: int) -> Listener:
    return Listener(spec.name, spec.source_of("port"), spec.machine, spec.bind_address, first, last, "vLLM", "port")


def _ssh(spec: HostSpec) -> Listener:
    return Listener(
        spec.name, spec.source_of("ssh_port"), spec.machine, None, spec.ssh_port, spec.ssh_port, "ssh", "ssh_port"
    )


def spec_listeners(specs: Iterable[HostSpec]) -> list[Listener]:
    """The declared listeners: ``port`` .. ``port + gpu.count - 1``, and ``ssh_port``, of every host."""
    listeners: list[Listener] = []
    for spec in specs:
        count = spec.gpu.count if spec.gpu is not None else 1
        listeners += [_vllm(spec, spec.port, spec.port + count - 1), _ssh(spec)]
    return listeners


def spec_port_problems(specs: Iterable[HostSpec]) -> list[FieldProblem]:
    """Collisions of the declared ranges: ``port`` .. ``port + gpu.count - 1``, and ``ssh_port``."""
    return collisions(spec_listeners(specs))


def plan_port_problems(hosts: Iterable[tuple[HostSpec, Sequence[int]]]) -> list[FieldProblem]:
    """Collisions of the ports planned instances really listen on (``Instance.port`` per host)."""
    listeners: list[Listener] = []
    for spec, ports in hosts:
        listeners += [_vllm(spec, p, p) for p in ports]
        listeners.append(_ssh(spec))
    return collisions(listeners)

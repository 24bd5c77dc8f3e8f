"""The multi-node network fact (``fleet.facts.node_network``): the probe run for real on this
machine over loopback (a port that listens, one that refuses, one whose SYNs are dropped), its
RDMA reading on a sysfs tree shaped like the kernel's, and the parser on recorded answers."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.facts import node_network_probe as probe
from fleet.facts.node_network import NodeNetwork, parse_node_network


def run(address: str, port: int, timeout: float = 1.0) -> list[str]:
    """The fact's command as the SSH runner sends it, through sh, on this machine."""
    command = NodeNetwork().command(address=address, port=port, timeout=timeout)
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()


@pytest.fixture
def listening() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()


def test_a_listening_leader_is_open(listening: int) -> None:
    net = parse_node_network(run("127.0.0.1", listening))
    assert net.ok and net.connect is not None
    assert (net.connect.outcome, net.connect.port, net.connect.reachable) == ("open", listening, True)
    assert net.route is not None and net.route.dev == "lo" and net.route.kind == "local"
    assert net.route.mtu == int(Path("/sys/class/net/lo/mtu").read_text())


def test_nothing_listening_is_refused_and_still_reachable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # bound once, now closed: the kernel answers RST
    net = parse_node_network(run("127.0.0.1", port))
    assert net.connect is not None
    assert (net.connect.outcome, net.connect.errno, net.connect.reachable) == ("refused", 111, True)


def test_dropped_syns_time_out_and_are_not_reachable() -> None:
    """A listener whose accept queue is full: Linux drops further SYNs (tcp_abort_on_overflow=0),
    as a firewall's DROP does."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    filler = socket.create_connection(srv.getsockname(), timeout=2)
    try:
        net = parse_node_network(run("127.0.0.1", srv.getsockname()[1], timeout=0.5))
    finally:
        filler.close()
        srv.close()
    assert net.connect is not None
    assert (net.connect.outcome, net.connect.reachable) == ("timeout", False)
    assert net.connect.seconds >= 0.4


def test_the_leader_itself_does_not_dial() -> None:
    net = parse_node_network(run("127.0.0.1", 0))
    assert net.ok and net.connect is None and net.route is not None and net.route.dev == "lo"


def _port(root: Path, device: str, port: int, state: str, layer: str, rate: str) -> None:
    d = root / device / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "link_layer").write_text(layer + "\n")
    (d / "rate").write_text(rate + "\n")


def test_rdma_ports_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    """Documentation/ABI/stable/sysfs-class-infiniband: ``state`` is ``4: ACTIVE``, ``link_layer``
    ``InfiniBand`` or ``Ethernet``, ``rate`` like ``200 Gb/sec (4X HDR)``."""
    _port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)")
    _port(tmp_path, "mlx5_1", 1, "1: DOWN", "InfiniBand", "10 Gb/sec (4X SDR)")
    raw = probe.rdma(str(tmp_path))
    line = json.dumps({"schema": 1, "status": "ok", "address": "a", "rdma": raw})
    net = parse_node_network([line])
    assert net.rdma_present
    assert [(p.device, p.port, p.state, p.link_layer, p.active) for p in net.rdma] == [
        ("mlx5_0", 1, "ACTIVE", "InfiniBand", True),
        ("mlx5_1", 1, "DOWN", "InfiniBand", False),
    ]
    assert net.rdma[0].describe() == "mlx5_0 port 1 ACTIVE (InfiniBand, 200 Gb/sec (4X HDR))"
    assert probe.rdma(str(tmp_path / "none")) == {"present": False, "ports": [], "error": None}


# Recorded from the probe on a lab-like host (loopback), then one value changed per row.
RECORDED = (
    '{"schema": 1, "status": "ok", "error": null, "address": "127.0.250.3", "resolved": "127.0.250.3", '
    '"connect": {"port": 29501, "outcome": "refused", "errno": 111, "error": "Connection refused", "seconds": 0.0}, '
    '"route": {"dev": "lo", "src": "127.0.0.1", "type": "local", "mtu": 65536, "route_mtu": null, "error": null}, '
    '"rdma": {"present": false, "ports": [], "error": null}}'
)


@pytest.mark.parametrize(
    ("lines", "status", "why"),
    [
        (["noise", RECORDED, ""], "ok", None),
        (['{"schema": 1, "status": "no-python", "error": "no python3 on the host"}'], "no-python", "no python3"),
        (['{"schema": 1, "status": "probe-crashed", "error": "OSError: x"}'], "probe-crashed", "OSError"),
        (["Traceback (most recent call last):"], "bad-output", "not JSON"),
        (['{"status": "weird"}'], "bad-output", "unexpected answer"),
        ([RECORDED.replace('"outcome": "refused"', '"outcome": "maybe"')], "bad-output", "connect"),
        ([RECORDED.replace('"mtu": 65536', '"mtu": "big"')], "bad-output", "not a number"),
        ([RECORDED.replace('"ports": []', '"ports": [7]')], "bad-output", "rdma port"),
    ],
)
def test_parse(lines: list[str], status: str, why: str | None) -> None:
    net = parse_node_network(lines)
    assert net.status == status
    assert (net.error is None) if why is None else (why in (net.error or ""))


def test_a_name_that_does_not_resolve_is_not_reachable() -> None:
    """(Recorded: the probe's answer for a leader name without an address; tests look up no names.)"""
    line = (
        '{"schema": 1, "status": "ok", "error": null, "address": "leader.invalid", "resolved": null, '
        '"connect": {"port": 29501, "outcome": "unresolved", "errno": null, '
        '"error": "leader.invalid does not resolve: [Errno -2] Name or service not known", "seconds": 0.0}, '
        '"route": {"dev": null, "src": null, "type": null, "mtu": null, "route_mtu": null, '
        '"error": "leader.invalid does not resolve: [Errno -2] Name or service not known"}, '
        '"rdma": {"present": false, "ports": [], "error": null}}'
    )
    net = parse_node_network([line])
    assert net.connect is not None and net.connect.outcome == "unresolved" and not net.connect.reachable
    assert net.route is not None and net.route.effective_mtu is None and "leader.invalid" in (net.route.error or "")


def test_route_mtu_wins_over_the_interfaces() -> None:
    net = parse_node_network([RECORDED.replace('"route_mtu": null', '"route_mtu": 1400')])
    assert net.route is not None and net.route.effective_mtu == 1400
    assert parse_node_network([RECORDED]).route.effective_mtu == 65536  # type: ignore[union-attr]


def test_command_quotes_its_arguments() -> None:
    command = NodeNetwork().command(address="a b;rm -rf /", port=29501, timeout=3)
    assert "python3 -I - 'a b;rm -rf /' 29501 3.0 <<" in command

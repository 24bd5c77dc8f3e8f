"""The fact runner's connect phase (``fleet.facts.runner.open_connections``): every host's SSH port
at once, each bounded, before any SSH session; then SSH over the connected socket, host key checked.

Hosts here are on loopback: one that answers (paramiko's SSH server side, as in
``test_rollout_ssh_conn``), one that refuses (an address of ``127.0.250.0/24``, where nothing
listens), and one that is silent (a listener whose accept queue is full: the kernel drops further
SYNs, as for a host that is down or firewalled; no root needed).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyinfra.api.facts import FactBase

from fleet.facts.runner import HostUnreachable, SshTarget, open_connections, run_fact_on_hosts

from .test_rollout_ssh_conn import SshServer

REFUSING = "127.0.250.7"  # nothing listens on 127.0.250.0/24 (outside the lab's octets)


class Silent:
    """A TCP port that never completes a handshake: ``listen(0)`` with its one queue slot taken."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port: int = self.listener.getsockname()[1]
        self.filler = socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self.filler.close()
        self.listener.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    s = Silent()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port that answers (a plain TCP listener: the connect phase needs no SSH)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SshServer]:
    s = SshServer(tmp_path)
    try:
        yield s
    finally:
        s.close()


class Echo(FactBase[str]):
    def command(self) -> str:
        return "echo hi"

    def process(self, output: list[str]) -> str:
        return "\n".join(output)


def test_open_connections_tells_answering_refusing_and_silent_hosts_apart(
    listener: socket.socket, silent: Silent
) -> None:
    port = listener.getsockname()[1]
    targets = [
        SshTarget("gpu01", "127.0.0.1", port),
        SshTarget("refuses", REFUSING, 22),
        *(SshTarget(f"silent-{i}", "127.0.0.1", silent.port) for i in range(3)),
        SshTarget("no-name", "no-such-host.invalid", 22),  # RFC 6761: never resolves
    ]
    got = open_connections(targets, timeout=0.5)
    try:
        assert list(got) and set(got) == {t.name for t in targets}
        sock = got["gpu01"]
        assert isinstance(sock, socket.socket) and sock.getpeername() == ("127.0.0.1", port)
        assert got["refuses"] == "Connection refused"
        assert [got[f"silent-{i}"] for i in range(3)] == ["no answer within 0.5 s"] * 3
        assert str(got["no-name"]).startswith("cannot resolve no-such-host.invalid: ")
    finally:
        for value in got.values():
            if isinstance(value, socket.socket):
                value.close()


def test_the_fact_runs_over_the_connected_socket_and_the_others_say_why_not(server: SshServer, silent: Silent) -> None:
    answered: list[str] = []
    targets = [server.target(), SshTarget("refuses", REFUSING, 22), SshTarget("silent", "127.0.0.1", silent.port)]
    results = run_fact_on_hosts(targets, Echo, connect_timeout=0.5, progress=lambda host, _r: answered.append(host))
    assert results["gpu01"] == "hi"
    assert server.commands == ["echo hi"]
    assert results["refuses"] == HostUnreachable("refuses", f"cannot reach {REFUSING}:22: Connection refused")
    why = f"cannot reach 127.0.0.1:{silent.port}: no answer within 0.5 s"
    assert results["silent"] == HostUnreachable("silent", why)
    assert sorted(answered) == ["gpu01", "refuses", "silent"]


def test_the_host_key_is_still_checked_over_a_connected_socket(server: SshServer, tmp_path: Path) -> None:
    other = tmp_path / "other_known_hosts"
    other.write_text("")  # the host is not in it: refused, never added
    target = SshTarget("gpu01", "127.0.0.1", server.port, "fleet", str(server.key_file), str(other))
    (result,) = run_fact_on_hosts([target], Echo, connect_timeout=2).values()
    assert isinstance(result, HostUnreachable) and "is not in" in result.reason, result
    assert server.commands == [] and other.read_text() == ""


def test_many_hosts_in_waves_when_file_descriptors_are_short(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for fewer sockets than hosts, hosts go in waves and every one still gets its answer."""
    from fleet.facts import runner

    monkeypatch.setattr(runner, "_fd_budget", lambda wanted: 3)
    targets = [SshTarget(f"r{i}", f"127.0.250.{i + 1}", 22) for i in range(7)]
    answering = SshTarget("gpu01", "127.0.0.1", listener.getsockname()[1])
    got = runner.open_connections([*targets, answering], timeout=2)
    try:
        assert [got[t.name] for t in targets] == ["Connection refused"] * 7
        assert isinstance(got["gpu01"], socket.socket)
    finally:
        for value in got.values():
            if isinstance(value, socket.socket):
                value.close()

"""The rollout executor's SSH connection against a real SSH server (paramiko's server side, on
127.0.0.1): a host that goes down under a command is a lost connection, not an exit status; a
command that must not run twice (a hook) is not sent again after that. A host that stops
answering (a TCP proxy in between drops everything, as a partition does; a listener that takes
the connection and never speaks, as a frozen sshd does) ends every wait within its deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from fleet.facts.runner import SshTarget
from fleet.rollout.executor import ExecutorError
from fleet.rollout.ssh_executor import _Conn


class _Host(paramiko.ServerInterface):
    def __init__(self, server: SshServer) -> None:
        self.server = server

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        ok = username == "fleet" and key == self.server.client_key
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        self.server.commands.append(command.decode())
        threading.Thread(target=self.server.answer, args=(channel, command.decode()), daemon=True).start()
        return True


class SshServer:
    """Answers ``echo hi`` with ``hi`` and status 0; for ``crash`` the host "goes down": the whole
    connection is dropped before any exit status (the first ``crash_times`` times)."""

    def __init__(self, tmp: Path) -> None:
        self.host_key = paramiko.RSAKey.generate(2048)
        client = paramiko.RSAKey.generate(2048)
        self.client_key = paramiko.RSAKey(data=client.asbytes())
        self.key_file = tmp / "id_rsa"
        client.write_private_key_file(str(self.key_file))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        known = paramiko.HostKeys()
        known.add(f"[127.0.0.1]:{self.port}", self.host_key.get_name(), self.host_key)
        self.known_hosts = tmp / "known_hosts"
        known.save(str(self.known_hosts))
        self.commands: list[str] = []
        self.crash_times = 1
        self.transports: list[paramiko.Transport] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                return
            t = paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            self.transports.append(t)
            try:
                t.start_server(server=_Host(self))
            except (paramiko.SSHException, EOFError, OSError):
                continue  # the client went away during the handshake (it refused our host key)

    def answer(self, channel: paramiko.Channel, command: str) -> None:
        # As sshd does, answer once the exec request was acknowledged: the client has then closed
        # its stdin (``_Conn.run`` does right after ``exec_command`` returns) and reads the output.
        deadline = time.monotonic() + 5
        while not channel.eof_received and time.monotonic() < deadline:
            time.sleep(0.01)
        if command.startswith("sleep "):  # a command that takes its time (systemctl stop while vLLM drains)
            time.sleep(float(command.split()[1]))
        if command == "crash" and self.crash_times > 0:
            self.crash_times -= 1
            channel.get_transport().close()  # the host is gone: no exit status, no channel close
            return
        try:
            channel.sendall(b"hi\n")
            channel.send_exit_status(0)
            channel.close()
        except OSError:  # the client went away first (a test closed or cut the connection)
            pass

    def target(self) -> SshTarget:
        return SshTarget("gpu01", "127.0.0.1", self.port, "fleet", str(self.key_file), str(self.known_hosts))

    def close(self) -> None:
        self.sock.close()
        for t in self.transports:
            t.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SshServer]:
    s = SshServer(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_a_command_answers(server: SshServer) -> None:
    conn = _Conn(server.target())
    try:
        assert conn.run("echo hi", 10) == (0, "hi\n", "")
    finally:
        conn.close()


def test_a_connection_lost_under_a_command_reconnects_and_sends_it_again(server: SshServer) -> None:
    conn = _Conn(server.target())
    try:
        assert conn.run("crash", 10) == (0, "hi\n", "")  # the host came back: the second try answers
        assert server.commands == ["crash", "crash"]
    finally:
        conn.close()


def test_a_command_that_must_not_run_twice_is_not_sent_again(server: SshServer) -> None:
    conn = _Conn(server.target())
    try:
        with pytest.raises(ExecutorError) as exc:
            conn.run("crash", 10, resend=False)
        assert str(exc.value).startswith("host gpu01: SSH failed after the command was sent (it may have run): ")
        assert server.commands == ["crash"]
    finally:
        conn.close()


def test_a_host_that_stays_down_is_an_ssh_failure_not_an_exit_status(server: SshServer) -> None:
    server.crash_times = 2
    conn = _Conn(server.target())
    try:
        with pytest.raises(ExecutorError) as exc:
            conn.run("crash", 10)
        assert str(exc.value) == "host gpu01: SSH failed: the connection closed before the exit status of `crash` came"
        assert server.commands == ["crash", "crash"]
    finally:
        conn.close()


# ---- a host that stops answering ------------------------------------------------------------------

FAST = {"silent_s": 1.0, "heartbeat_s": 0.2, "connect_s": 2.0, "retry_after_s": 30.0}


class Partition:
    """A TCP proxy on 127.0.0.1 in front of the server; ``cut()`` drops every byte both ways from
    then on and keeps the connections open, as packets dropped on the way do."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.dropping = threading.Event()
        self.accepted = 0
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.dropping.is_set():
                self.socks.append(conn)  # taken by the kernel, never answered
                continue
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.socks += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.dropping.is_set():
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def cut(self) -> None:
        self.dropping.set()

    def close(self) -> None:
        self.sock.close()
        for s in self.socks:
            s.close()


@pytest.fixture
def partition(server: SshServer) -> Iterator[Partition]:
    p = Partition(server.port)
    try:
        yield p
    finally:
        p.close()


def _via(server: SshServer, partition: Partition) -> SshTarget:
    known = paramiko.HostKeys()
    known.add(f"[127.0.0.1]:{partition.port}", server.host_key.get_name(), server.host_key)
    path = server.known_hosts.with_name("known_hosts_proxy")
    known.save(str(path))
    return SshTarget("gpu01", "127.0.0.1", partition.port, "fleet", str(server.key_file), str(path))


def test_a_command_on_a_connection_that_goes_silent_ends_once_the_host_is_silent_for_silent_s(
    server: SshServer, partition: Partition
) -> None:
    """The bug: a command on an open connection had no deadline but its own (``systemctl stop``:
    15 minutes), and the partition held it for as long as it lasted. Now the heartbeat goes
    unanswered and the command ends about ``silent_s`` after the host was last heard from."""
    conn = _Conn(_via(server, partition), **FAST)
    try:
        assert conn.run("echo hi", 10) == (0, "hi\n", "")
        threading.Timer(0.3, partition.cut).start()
        t0 = time.monotonic()
        with pytest.raises(ExecutorError) as exc:
            conn.run("sleep 30", 900, label="systemctl stop fleet-vllm-0.service")
        took = time.monotonic() - t0
        assert 1.0 <= took < 3.0, took
        assert str(exc.value).startswith("host gpu01: SSH failed: unreachable: no answer to SSH keepalives for 1s")
        assert str(exc.value).endswith("during systemctl stop fleet-vllm-0.service")
        assert server.commands == ["echo hi", "sleep 30"]  # not sent again: the host did not answer
        # later calls fail at once with the same reason, without trying (retry_after_s)
        accepted = partition.accepted
        t1 = time.monotonic()
        with pytest.raises(ExecutorError, match="unreachable: no answer to SSH keepalives"):
            conn.run("echo hi", 10)
        assert time.monotonic() - t1 < 0.5 and partition.accepted == accepted
    finally:
        conn.close()


def test_down_since_is_when_the_host_was_last_heard_from(server: SshServer, partition: Partition) -> None:
    conn = _Conn(_via(server, partition), **FAST)
    try:
        conn.run("echo hi", 10)
        cut_at = time.time()
        partition.cut()
        with pytest.raises(ExecutorError):
            conn.run("sleep 30", 60)
        assert conn.down_since is not None and cut_at - 0.5 <= conn.down_since <= cut_at + 0.5
    finally:
        conn.close()


def test_a_host_that_takes_the_connection_but_never_speaks_ssh_is_unreachable_within_the_connect_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen host: its kernel completes the TCP handshake, sshd never sends its banner. The
    connect ends at its deadline with one line, and paramiko's traceback of it ("Exception
    (client): Error reading SSH protocol banner") goes to fleet's log file, not to stderr."""
    import logging

    from fleet import logs
    from fleet.facts import sshlink

    monkeypatch.setenv("FLEET_LOG", str(tmp_path / "fleet.log"))
    monkeypatch.setattr(logs, "_handler", None)
    paramiko_logger = logging.getLogger("paramiko")
    monkeypatch.setattr(paramiko_logger, "handlers", [])
    monkeypatch.setattr(paramiko_logger, "propagate", True)
    logs.route_library_logs()
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    port = frozen.getsockname()[1]
    try:
        target = SshTarget("gpu01", "127.0.0.1", port, "fleet", None, str(tmp_path / "known_hosts"))
        t0 = time.monotonic()
        with pytest.raises(sshlink.Unreachable) as exc:
            sshlink.connect(target, timeout=1.0)
        assert time.monotonic() - t0 < 2.5
        assert str(exc.value) == (
            f"host gpu01: SSH failed: unreachable: 127.0.0.1:{port} took the TCP connection but the SSH handshake "
            "did not finish within 1s (sshd does not answer: host frozen or overloaded?)"
        )
    finally:
        frozen.close()
    time.sleep(0.3)  # paramiko's transport thread logs as it ends
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "protocol banner" not in captured.err, captured.err
    logs.handler().flush()
    assert "Error reading SSH protocol banner" in (tmp_path / "fleet.log").read_text()
    assert (tmp_path / "fleet.log").stat().st_mode & 0o077 == 0


def test_a_command_over_its_deadline_on_a_live_host_is_a_timeout_not_unreachable(server: SshServer) -> None:
    conn = _Conn(server.target(), **FAST)
    try:
        t0 = time.monotonic()
        with pytest.raises(ExecutorError) as exc:
            conn.run("sleep 5", 1.5, label="the fleet-kill script")
        assert 1.5 <= time.monotonic() - t0 < 2.5
        assert str(exc.value) == "host gpu01: SSH failed: the fleet-kill script did not finish within 1.5s"
        assert conn.down_since is None  # the host answered its heartbeats all along
        assert conn.run("echo hi", 10) == (0, "hi\n", "")  # and the connection still serves
    finally:
        conn.close()


def test_close_from_another_thread_ends_a_command_in_flight_and_nothing_is_sent_after(server: SshServer) -> None:
    """The second Ctrl-C: the executor's connections are closed while steps are in flight."""
    conn = _Conn(server.target(), **FAST)
    try:
        conn.run("echo hi", 10)
        threading.Timer(0.3, conn.close).start()
        t0 = time.monotonic()
        with pytest.raises(ExecutorError):
            conn.run("sleep 30", 900)
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(ExecutorError, match="not sent: fleet is stopping"):
            conn.run("echo hi", 10)
        assert server.commands == ["echo hi", "sleep 30"]  # not sent again on a new connection
    finally:
        conn.close()


def test_a_changed_host_key_shows_both_fingerprints_and_the_file_fleet_reads(server: SshServer, tmp_path: Path) -> None:
    """Issue 25.7: the advice was pyinfra's ``ssh-keygen -R HOST`` (it edits ~/.ssh/known_hosts,
    not the inventory's file) and the keys were shown with parts replaced by <redacted>."""
    import shlex

    from fleet.facts import sshlink
    from fleet.secrets import redact

    other = paramiko.ECDSAKey.generate()
    known = paramiko.HostKeys()
    known.add(f"[127.0.0.1]:{server.port}", other.get_name(), other)
    path = tmp_path / "fleet known_hosts"  # a space: the advice quotes it
    known.save(str(path))
    target = SshTarget("gpu01", "127.0.0.1", server.port, "fleet", str(server.key_file), str(path))
    with pytest.raises(sshlink.HostKeyError) as exc:
        sshlink.connect(target, timeout=5)
    text = str(exc.value)
    assert text.startswith(f"host gpu01: SSH failed: the host key of [127.0.0.1]:{server.port} has changed: ")
    assert f"{path} holds ECDSA {other.fingerprint}, the host offered RSA {server.host_key.fingerprint}" in text
    assert f"ssh-keygen -R '[127.0.0.1]:{server.port}' -f {shlex.quote(str(path))}" in text
    assert "~/.ssh" not in text and redact(text) == text  # nothing in it looks like a secret
    assert server.commands == []


def test_an_unknown_host_key_is_refused_with_its_fingerprint(server: SshServer, tmp_path: Path) -> None:
    from fleet.facts import sshlink

    target = SshTarget("gpu01", "127.0.0.1", server.port, "fleet", str(server.key_file), str(tmp_path / "empty"))
    with pytest.raises(sshlink.HostKeyError) as exc:
        sshlink.connect(target, timeout=5)
    assert str(exc.value).startswith(
        f"host gpu01: SSH failed: [127.0.0.1]:{server.port} is not in {tmp_path / 'empty'} (it offered RSA "
        f"{server.host_key.fingerprint}); check that fingerprint out of band"
    )


def test_an_unreachable_host_is_tried_again_once_retry_after_s_has_passed(
    server: SshServer, partition: Partition
) -> None:
    """Calls in the window fail at once (they do not push the window out); the first call after
    it tries a new connection (here it is taken and never answered: the connect deadline)."""
    # a window of 3 s, calls in its first second only: a call slowed by a loaded machine still lands
    # inside it (with a 1 s window and calls for 0.8 s, one landed after it on a loaded CI machine)
    conn = _Conn(_via(server, partition), **{**FAST, "retry_after_s": 3.0, "connect_s": 0.5})
    try:
        conn.run("echo hi", 10)
        partition.cut()
        with pytest.raises(ExecutorError, match="no answer to SSH keepalives"):
            conn.run("sleep 30", 60)
        first = conn.down_since
        accepted = partition.accepted
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            with pytest.raises(ExecutorError, match="no answer to SSH keepalives"):
                conn.run("echo hi", 10)
            time.sleep(0.1)
        assert partition.accepted == accepted  # not tried within the window
        time.sleep(max(0.0, t0 + 3.2 - time.monotonic()))
        with pytest.raises(ExecutorError, match="took the TCP connection but the SSH handshake did not finish"):
            conn.run("echo hi", 10)
        assert partition.accepted == accepted + 1
        assert conn.down_since == first  # still down since it was last heard from
    finally:
        conn.close()

"""The rollout executor's SSH connection against a real SSH server (paramiko's server side, on
127.0.0.1): a host that goes down under a command is a lost connection, not an exit status; a
command that must not run twice (a hook) is not sent again after that."""

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
            t.start_server(server=_Host(self))

    def answer(self, channel: paramiko.Channel, command: str) -> None:
        # As sshd does, answer once the exec request was acknowledged: the client has then closed
        # its stdin (``_Conn.run`` does right after ``exec_command`` returns) and reads the output.
        deadline = time.monotonic() + 5
        while not channel.eof_received and time.monotonic() < deadline:
            time.sleep(0.01)
        if command == "crash" and self.crash_times > 0:
            self.crash_times -= 1
            channel.get_transport().close()  # the host is gone: no exit status, no channel close
            return
        channel.sendall(b"hi\n")
        channel.send_exit_status(0)
        channel.close()

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
        assert str(exc.value) == ("host gpu01: SSH failed: the connection closed before the command's exit status came")
        assert server.commands == ["crash", "crash"]
    finally:
        conn.close()

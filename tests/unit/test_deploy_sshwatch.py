"""``fleet deploy``'s reason for a host pyinfra could not connect to: fleet's one line, from the
paramiko or socket error pyinfra's ``ConnectError`` was raised from (issue 25.8: the deploy table
said "could not connect over SSH (see the log)")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import paramiko
import pytest
from pyinfra.api.exceptions import ConnectError

from fleet.deploy.sshwatch import why_not_connected


class _Data:
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def dict(self) -> dict[str, Any]:
        return self._data


class _Host:
    def __init__(self, name: str, data: dict[str, Any]) -> None:
        self.name, self.data = name, _Data(data)


def _raised_from(cause: BaseException, message: str) -> ConnectError:
    """A ConnectError raised while handling ``cause``, as pyinfra's connector raises it."""
    try:
        try:
            raise cause
        except BaseException:
            raise ConnectError(message)  # noqa: B904 (implicit chaining, as pyinfra's raise_connect_error)
    except ConnectError as exc:
        return exc


HOST = _Host("gpu07", {"ssh_hostname": "127.0.0.7", "ssh_port": 2222, "ssh_known_hosts_file": "/etc/fleet/known"})


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (
            paramiko.SSHException("Error reading SSH protocol banner"),
            "unreachable: 127.0.0.7:2222 took the TCP connection but the SSH handshake did not finish "
            "(sshd does not answer: host frozen or overloaded?)",
        ),
        (
            paramiko.SSHException("No existing session"),
            "unreachable: 127.0.0.7:2222 took the TCP connection but the SSH handshake did not finish "
            "(sshd does not answer: host frozen or overloaded?)",
        ),
        (
            TimeoutError("timed out"),
            "unreachable: 127.0.0.7:2222 did not answer the TCP connect within 15s (down, or the network drops it)",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "unreachable: 127.0.0.7:2222 refused the connection (no sshd listening)",
        ),
    ],
)
def test_the_reason_is_fleets_one_line(cause: BaseException, reason: str) -> None:
    error = _raised_from(cause, f"SSH error ({cause})")
    assert why_not_connected(HOST, error, 15) == reason  # type: ignore[arg-type]


def test_a_changed_host_key_shows_fingerprints_and_the_file_fleet_reads(tmp_path: Path) -> None:
    expected, offered = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    cause = paramiko.BadHostKeyException("127.0.0.7", offered, expected)
    error = _raised_from(cause, "SSH host key error (Host key for 127.0.0.7 does not match.)")
    reason = why_not_connected(HOST, error, 15)  # type: ignore[arg-type]
    assert reason.startswith(
        f"the host key of [127.0.0.7]:2222 has changed: /etc/fleet/known holds ECDSA {expected.fingerprint}, "
        f"the host offered ECDSA {offered.fingerprint}; refused"
    )
    assert "`ssh-keygen -R '[127.0.0.7]:2222' -f /etc/fleet/known`" in reason


def test_without_a_cause_pyinfras_message_is_kept() -> None:
    assert why_not_connected(HOST, ConnectError("Authentication error (username=fleet)"), 15) == (  # type: ignore[arg-type]
        "Authentication error (username=fleet)"
    )

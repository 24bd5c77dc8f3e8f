"""SSH into lab hosts with paramiko, checking host keys strictly against the lab's known_hosts."""

from __future__ import annotations

from pathlib import Path

import paramiko

from fleetlab.base import LOGIN_USER


def connect(
    address: str, port: int, key: Path, known_hosts: Path, user: str = LOGIN_USER, timeout: float = 10.0
) -> paramiko.SSHClient:
    """An SSH client logged in as ``user``; an unknown or changed host key is refused."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        address, port=port, username=user, key_filename=str(key), allow_agent=False, look_for_keys=False,
        timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
    )  # fmt: skip
    return client


def run(client: paramiko.SSHClient, command: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """Run ``command`` on the host; return (exit status, stdout, stderr)."""
    _stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
    out = stdout.read().decode(errors="replace")
    err = stderr.read().decode(errors="replace")
    return stdout.channel.recv_exit_status(), out, err

"""SSH keys the lab generates on the control machine: the control key pair and host keys.

Host keys are made here (not by the host on first boot) so the lab can write a ``known_hosts``
before any connection and every client can check host keys strictly.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from fleetlab.errors import LabError


def generate_ed25519(path: Path, comment: str) -> Path:
    """Create an ed25519 key pair at ``path`` (and ``path.pub``) unless it exists; return ``path``."""
    if path.is_file() and path.with_suffix(".pub").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, Path(f"{path}.pub")):
        p.unlink(missing_ok=True)
    result = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise LabError(f"ssh-keygen could not create {path}: {result.stderr.strip()}")
    path.chmod(0o600)
    return path


def public_key(path: Path) -> str:
    """The ``type base64`` part of the public key next to private key ``path`` (no comment)."""
    kind, blob, *_ = Path(f"{path}.pub").read_text().split()
    return f"{kind} {blob}"


def known_hosts_name(address: str, port: int) -> str:
    """The host name OpenSSH and paramiko look up: ``addr`` for port 22, ``[addr]:port`` otherwise."""
    return address if port == 22 else f"[{address}]:{port}"


def known_hosts_line(address: str, port: int, host_key: Path) -> str:
    """One ``known_hosts`` line for a host's key."""
    return f"{known_hosts_name(address, port)} {public_key(host_key)}"

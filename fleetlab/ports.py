"""Is the SSH port free at a lab host's address? Read from /proc/net/tcp{,6}, before booting.

Hosts share this machine's network namespace, so a control-machine sshd listening on the
wildcard address at the same port would make every lab sshd fail to bind.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

LISTEN = "0A"


def _listeners(proc_net: Path = Path("/proc/net")) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket."""
    found: list[tuple[str, int]] = []
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = str(ipaddress.ip_address(words))
            found.append((addr, int(hex_port, 16)))
    return found


def port_conflict(address: str, port: int, proc_net: Path = Path("/proc/net")) -> str | None:
    """Who already listens where ``address:port`` would bind, or None when it is free."""
    for addr, p in _listeners(proc_net):
        if p == port and addr in ("0.0.0.0", "::", address):
            return f"{addr}:{p}"
    return None

"""The lab's air gap: lab hosts reach only the lab's package index and apt repository.

Lab hosts share the control machine's network namespace (``machine.py``), so there is no
interface of their own to filter. What tells their traffic apart is the cgroup their processes
run in: every process of a host lives under that host's cgroup (``cgroups.py``; a scope of
systemd's when systemd is PID 1 here), and nftables can match the cgroup (v2) of the socket a
packet leaves from (nft(8), "SOCKET EXPRESSION": ``socket cgroupv2 level N "path"``; the
kernel's ``nft_socket``, Linux >= 5.13). One table per lab, ``inet fleet_lab_<lab>``, holds
one output-hook chain that sends each host's packets to a chain of its own::

    established or related          accept   (answers on connections made to the host: SSH)
    to the host's own address       accept   (its services talking to themselves)
    to the index address:port (TCP) accept   (pip and apt: the lab's index serves both)
    to another host of the lab,
      at one of its peer ports (TCP) accept   (``PEER_PORTS``: fleet's staging port, vLLM's rendezvous)
    anything else                   reject with icmpx admin-prohibited

so a connection anywhere else fails at once (``EHOSTUNREACH``, ``EACCES`` over IPv6, ``EPERM``
for UDP) instead of hanging: the control machine's other ports on 127.0.0.1 and ::1, the other
lab hosts, DNS, any public address. Packets not sent from a host's sockets (the control machine's own, SYN-ACKs of the
hosts' listeners) do not match and pass. nft resolves a cgroup path to its id when the rule is
loaded, so the table is loaded again whenever a host's cgroup is made anew (``up``,
``restart_host``); ``down`` deletes it. The rules are written by :func:`ruleset` (pure).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fleet.inventory.schema import DEFAULT_STAGING_PORT
from fleetlab import cgroups
from fleetlab.errors import LabError

#: The TCP ports the hosts of one lab may reach on each other (and nothing else of each other):
#: fleet's staging port (``fleet stage --fanout``: a host sends the model to the next) and 29501,
#: vLLM 0.33's default ``master_port`` (``ParallelConfig``, ``vllm/config/parallel.py``), the
#: leader's rendezvous for an instance spanning hosts, the one port the lab's stand-in opens between
#: nodes (``vllm/standin/nodes.py``; the real engine also opens ports of its own choosing between
#: nodes, message queues and NCCL, which the lab does not run). Add one here for another
#: host-to-host protocol.
PEER_PORTS: tuple[int, ...] = (DEFAULT_STAGING_PORT, 29501)

#: nft names cgroup paths relative to this directory (nftables' SYSFS_CGROUPSV2_PATH).
NFT_CGROUP_BASE = Path("/sys/fs/cgroup")
NO_AIR_GAP_HINT = "or run `fleet lab up --no-air-gap` (hosts then reach any address this machine can)"


@dataclass(frozen=True)
class Endpoint:
    """An address and TCP port lab hosts may connect to."""

    address: str
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @staticmethod
    def parse(text: str) -> Endpoint:
        address, _, port = text.rpartition(":")
        return Endpoint(address.strip("[]"), int(port))


@dataclass(frozen=True)
class HostRule:
    """One lab host as the rules see it: its address and its cgroup (v2)."""

    name: str
    address: str
    cgroup: str  #: relative to ``NFT_CGROUP_BASE``, as nft takes it
    level: int  #: the cgroup's depth in the v2 hierarchy (``fleet-lab/<host>``: 2)


def table_name(lab: str) -> str:
    """``fleet_lab_<lab>``: lab names are lower-case letters, digits and dashes."""
    return "fleet_lab_" + lab.replace("-", "_")


def endpoint_of(url: str) -> Endpoint:
    """The address and port of an index URL; the air gap needs an IP address to allow."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise LabError(
            f"the air gap allows addresses, not names: {url} names {host!r}; give the index by IP address "
            + NO_AIR_GAP_HINT
        ) from None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Endpoint(address, port)


def _family(address: str) -> str:
    return "ip6" if ipaddress.ip_address(address).version == 6 else "ip"


def ruleset(lab: str, hosts: Sequence[HostRule], allowed: Sequence[Endpoint], peer_ports: Sequence[int] = ()) -> str:
    """The nft script that replaces the lab's table (one transaction: never half applied).
    ``peer_ports``: TCP ports each host may reach on the lab's other hosts."""
    table = table_name(lab)
    lines = [
        f"table inet {table}",  # so that the delete below always finds it
        f"delete table inet {table}",
        f"table inet {table} {{",
        "  chain output {",
        "    type filter hook output priority filter; policy accept;",
    ]
    for i, h in enumerate(hosts):
        lines.append(f'    socket cgroupv2 level {h.level} "{h.cgroup}" jump host_{i}  # {h.name}')
    lines.append("  }")
    for i, h in enumerate(hosts):
        lines += [
            f"  chain host_{i} {{  # {h.name}",
            "    ct state established,related accept",
            f"    {_family(h.address)} daddr {h.address} accept",
        ]
        lines += [f"    {_family(e.address)} daddr {e.address} tcp dport {e.port} accept" for e in allowed]
        ports = ", ".join(str(p) for p in sorted(set(peer_ports)))
        for family in ("ip", "ip6"):
            peers = sorted({p.address for p in hosts if p.address != h.address and _family(p.address) == family})
            if peers and ports:
                lines.append(f"    {family} daddr {{ {', '.join(peers)} }} tcp dport {{ {ports} }} accept  # peers")
        lines += ["    counter reject with icmpx admin-prohibited", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def cgroup2_root() -> Path | None:
    """Where the unified (v2) cgroup hierarchy is mounted here, or None without one."""
    for root in (NFT_CGROUP_BASE, NFT_CGROUP_BASE / "unified"):
        if (root / "cgroup.controllers").exists():
            return root
    return None


def unavailable() -> str | None:
    """Why the air gap cannot be applied on this machine, or None."""
    if shutil.which("nft") is None:
        return "nft is not installed (apt-get install nftables)"
    if cgroup2_root() is None:
        return "this machine has no cgroup v2 hierarchy, which the rules match lab hosts by"
    return None


def host_cgroup(machine: str, nspawn_pid: int | None) -> Path | None:
    """The v2 cgroup that holds every process of a lab host, or None when it cannot be told.

    Without systemd as PID 1 here it is the one ``cgroups.py`` made for the host; with it, the
    scope systemd gave nspawn (nspawn's own cgroup, less its ``supervisor`` leaf).
    """
    root = cgroup2_root()
    if root is None:
        return None
    if not cgroups.systemd_is_pid1():
        mine = [p for p in cgroups.host_cgroups(machine) if p.parent.parent == root]
        return mine[0] if mine else None
    if nspawn_pid is None:
        return None
    try:
        lines = Path(f"/proc/{nspawn_pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::/"):
            path = line[3:].removesuffix("/supervisor")
            return root / path.lstrip("/")
    return None


def cgroup_match(cgroup: Path) -> tuple[str, int]:
    """How ``socket cgroupv2 level N "path"`` names a v2 cgroup: (path relative to
    ``NFT_CGROUP_BASE``, its depth in the v2 hierarchy)."""
    root = cgroup2_root()
    assert root is not None
    return str(cgroup.relative_to(NFT_CGROUP_BASE)), len(cgroup.relative_to(root).parts)


def host_rule(name: str, address: str, cgroup: Path) -> HostRule:
    path, level = cgroup_match(cgroup)
    return HostRule(name, address, path, level)


def nft(script: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``nft ARGS`` (with ``script`` on its stdin); the caller reads the return code."""
    return subprocess.run(["nft", *args], input=script, capture_output=True, text=True, timeout=30, check=False)


def delete_table(table: str) -> None:
    """Delete ``inet <table>`` (a no-op when there is none, or no nft)."""
    if shutil.which("nft") is None:
        return
    nft(f"table inet {table}\ndelete table inet {table}\n", "-f", "-")


def apply(lab: str, hosts: Sequence[HostRule], allowed: Sequence[Endpoint], peer_ports: Sequence[int] = ()) -> None:
    """Load the lab's table (replacing the one loaded before)."""
    why = unavailable()
    if why is not None:
        raise LabError(f"cannot cut lab {lab!r} off the network: {why}; install it " + NO_AIR_GAP_HINT)
    done = nft(ruleset(lab, hosts, allowed, peer_ports), "-f", "-")
    if done.returncode != 0:
        why = done.stderr.strip()[-500:]
        raise LabError(f"nft refused the air gap rules of lab {lab!r}: {why}; " + NO_AIR_GAP_HINT)


def remove(lab: str) -> None:
    """Delete the lab's table (a no-op when there is none, or no nft)."""
    delete_table(table_name(lab))


def listed(lab: str) -> str | None:
    """The lab's table as nft lists it now, or None when it is not loaded."""
    if shutil.which("nft") is None:
        return None
    done = nft(None, "list", "table", "inet", table_name(lab))
    return done.stdout if done.returncode == 0 else None

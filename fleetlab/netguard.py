"""The network guard of test runs and benchmarks: what they start reaches loopback and nothing else.

Tests and benchmarks may connect only to loopback (``127.0.0.0/8`` and ``::1``), where the
lab's hosts, package index and apt repository live. In-process patching (pytest-socket) does not
see what a test runs as a subprocess (``fleet``, ssh, pip, Ansible, curl), so :func:`up` moves
the calling process into a cgroup (v2) of its own, a child of the one it runs in, and every
process it starts from then on inherits it. One nftables table, ``inet fleet_guard_<pid>``,
matches the packets sent from that cgroup's sockets (``socket cgroupv2 level N "path"``, the
match the lab's air gap uses: ``airgap.py``; nft(8), "SOCKET EXPRESSION")::

    to 127.0.0.0/8 or ::1                         accept
    to a package source of this machine (below)   accept   (address and port)
    anything else                                 record the destination, log, reject

so a connection anywhere else fails at once (``EHOSTUNREACH``, ``EACCES`` over IPv6, ``EPERM``
for UDP) instead of hanging on a silent address. What was refused is kept in the table's sets
``refused4`` / ``refused6`` (destination, protocol, port, packets), which :meth:`Guard.news`
reads so that the test run can fail the test that did it; the kernel log gets a rate-limited
line per refused packet (prefix ``fleet-guard``). The base chain's priority is the cgroup's
depth below ``filter`` (0), so a guard nested in another (a test that runs pytest or a
benchmark) sees its packets first.

Lab hosts run in cgroups of their own (nspawn's scope, or ``cgroups.py``'s), are not matched,
and are cut off by the lab's own air gap. The lab's index and apt repository run in the guarded
cgroup and only answer on loopback.

**Package sources.** On a machine whose lab cache is empty the lab needs this machine's own
package sources: debootstrap fetches the Debian base from the apt mirror, and ``pip download``
/ ``pip wheel`` fetch wheels through pip's configuration. :func:`package_sources` reads them at
run time from the machine's configuration, never from this code: the Debian mirror
``mirror.find_mirror`` picks for the lab's suite (or ``$FLEET_LAB_MIRROR``), the URLs of
``pip config list`` (which includes the ``PIP_*`` environment), pip's own default index where
none is configured (``pip._internal.models.index.PyPI``), and the proxies of ``http_proxy`` /
``https_proxy``. Their names are resolved when the guard goes up and allowed by address and
port, and DNS (port 53) to the nameservers of ``/etc/resolv.conf`` so that the tools can resolve
them. Everything else outside loopback is refused.

The table and the cgroup go away in :meth:`Guard.down` (the process moves back to where it came
from, with anything it left running); a table or cgroup left by a guard whose process died
without one (SIGKILL) is removed by the next :func:`up`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fleetlab import airgap, base, cgroups
from fleetlab.errors import LabError
from fleetlab.mirror import find_mirror

TABLE_PREFIX = "fleet_guard_"
CGROUP_PREFIX = "fleet-guard-"
LOOPBACK = ("127.0.0.0/8", "::1")
LOG_PREFIX = "fleet-guard refused: "
SET_SIZE = 65535

Resolver = Callable[[str, int], Sequence[str]]


class GuardUnavailable(LabError):
    """The guard cannot be put up here (not root, no nft, no cgroup v2...); the message says why."""


@dataclass(frozen=True)
class Allowance:
    """A destination outside loopback the guard lets through, and why."""

    address: str
    port: int
    protocols: tuple[str, ...]
    why: str

    def rule(self) -> str:
        family = "ip6" if ipaddress.ip_address(self.address).version == 6 else "ip"
        if self.protocols == ("tcp",):
            return f"{family} daddr {self.address} tcp dport {self.port} accept"
        protocols = ", ".join(self.protocols)
        return f"{family} daddr {self.address} meta l4proto {{ {protocols} }} th dport {self.port} accept"

    def __str__(self) -> str:
        where = f"[{self.address}]" if ":" in self.address else self.address
        return f"{where} {','.join(self.protocols)}/{self.port} ({self.why})"


@dataclass(frozen=True)
class Refusal:
    """A destination the guard refused, and how many packets to it so far."""

    address: str
    protocol: str
    port: int
    packets: int

    def __str__(self) -> str:
        where = f"[{self.address}]" if ":" in self.address else self.address
        return f"{where} {self.protocol}/{self.port} ({self.packets} packet{'s' if self.packets != 1 else ''})"


@dataclass(frozen=True)
class Source:
    """A package source of this machine, by name: what the lab's tools fetch from on a cold cache."""

    host: str
    port: int
    why: str


# -- pure ---------------------------------------------------------------------------------------


def table_name(pid: int) -> str:
    return f"{TABLE_PREFIX}{pid}"


def ruleset(table: str, cgroup: str, level: int, allowed: Sequence[Allowance]) -> str:
    """The nft script that (re)places the guard's table: one transaction, never half applied.

    ``cgroup`` is relative to ``airgap.NFT_CGROUP_BASE`` and ``level`` its depth in the v2
    hierarchy (``airgap.cgroup_match``).
    """
    lines = [
        f"table inet {table}",  # so that the delete below always finds it
        f"delete table inet {table}",
        f"table inet {table} {{",
        f"  set refused4 {{ type ipv4_addr . inet_proto . inet_service; flags dynamic; size {SET_SIZE}; counter; }}",
        f"  set refused6 {{ type ipv6_addr . inet_proto . inet_service; flags dynamic; size {SET_SIZE}; counter; }}",
        "  chain output {",
        f"    type filter hook output priority {-level}; policy accept;",
        f'    socket cgroupv2 level {level} "{cgroup}" jump guard',
        "  }",
        "  chain guard {",
        f"    ip daddr {LOOPBACK[0]} accept",
        f"    ip6 daddr {LOOPBACK[1]} accept",
        *(f"    {a.rule()}  # {a.why}" for a in allowed),
        "    meta nfproto ipv4 add @refused4 { ip daddr . meta l4proto . th dport counter }",
        "    meta nfproto ipv6 add @refused6 { ip6 daddr . meta l4proto . th dport counter }",
        f'    limit rate 10/second burst 20 packets log prefix "{LOG_PREFIX}" level warn',
        "    counter reject with icmpx admin-prohibited",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def parse_listing(listing: Mapping[str, Any]) -> tuple[int, dict[tuple[str, str, int], int]]:
    """From ``nft -j list table``: (packets the reject rule counted, {(address, protocol, port): packets})."""
    total = 0
    refused: dict[tuple[str, str, int], int] = {}
    for item in listing.get("nftables", []):
        rule = item.get("rule")
        if rule and rule.get("chain") == "guard":
            exprs = rule.get("expr", [])
            if any("reject" in e for e in exprs):
                total += sum(e["counter"]["packets"] for e in exprs if "counter" in e)
        found = item.get("set")
        if found and found.get("name") in ("refused4", "refused6"):
            for elem in found.get("elem", []):
                inner = elem.get("elem", elem) if isinstance(elem, dict) else {}
                value = inner.get("val", inner)
                concat = value.get("concat") if isinstance(value, dict) else None
                if not concat or len(concat) != 3:
                    continue
                address, protocol, port = concat
                packets = int(inner.get("counter", {}).get("packets", 1))
                refused[(str(address), str(protocol), int(port))] = packets
    return total, refused


def news(before: Mapping[tuple[str, str, int], int], now: Mapping[tuple[str, str, int], int]) -> list[Refusal]:
    """What was refused between two readings: destinations new or with more packets."""
    out = []
    for key, packets in sorted(now.items()):
        delta = packets - before.get(key, 0)
        if delta > 0:
            out.append(Refusal(key[0], key[1], key[2], delta))
    return out


def pip_config_urls(listing: str) -> list[tuple[str, str]]:
    """``(key, url)`` of every URL in ``pip config list`` output (index, extra index, find-links, proxy)."""
    out = []
    for line in listing.splitlines():
        m = re.fullmatch(r"\s*([^=\s]+)\s*=\s*'?(.*?)'?\s*", line)
        if not m:
            continue
        key = m.group(1).rpartition(".")[2]
        if key not in ("index-url", "extra-index-url", "find-links", "proxy"):
            continue
        for value in m.group(2).split():
            if key == "proxy" and "://" not in value:
                value = "http://" + value
            out.append((key, value))
    return out


def url_source(url: str, why: str) -> Source | None:
    """The host and port of an http(s) URL (``None`` for ``file:`` URLs and paths)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return Source(parts.hostname, port, f"{why} {parts.scheme}://{parts.netloc}")


def parse_nameservers(text: str) -> list[str]:
    """The ``nameserver`` addresses of a resolv.conf."""
    out = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            with contextlib.suppress(ValueError):
                out.append(str(ipaddress.ip_address(fields[1].split("%", 1)[0])))
    return out


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def allowances(
    sources: Sequence[Source], nameservers: Sequence[str], resolve: Resolver
) -> tuple[list[Allowance], list[str]]:
    """What to let through for ``sources`` (resolved with ``resolve``) and ``nameservers``, and
    the sources that could not be resolved (not allowed)."""
    whys: dict[tuple[str, int, tuple[str, ...]], list[str]] = {}
    problems = []
    for server in nameservers:
        if not is_loopback(server):
            whys.setdefault((server, 53, ("udp", "tcp")), ["nameserver"])
    for source in sources:
        try:
            addresses = resolve(source.host, source.port)
        except OSError as exc:
            problems.append(f"{source.host} ({source.why}): {exc}")
            continue
        for address in addresses:
            if not is_loopback(address):
                reasons = whys.setdefault((address, source.port, ("tcp",)), [])
                if source.why not in reasons:
                    reasons.append(source.why)
    return [Allowance(a, port, protocols, ", ".join(w)) for (a, port, protocols), w in whys.items()], problems


# -- reading this machine's configuration ---------------------------------------------------------


def pip_default_index() -> list[str]:
    """pip's own default index and file host, for a machine whose pip configuration names none."""
    try:
        from pip._internal.models.index import PyPI
    except ImportError:
        return []
    return [str(PyPI.url), f"https://{PyPI.file_storage_domain}/"]


def package_sources(env: Mapping[str, str] | None = None) -> list[Source]:
    """The package sources this machine's own configuration names (see the module docstring)."""
    env = os.environ if env is None else env
    sources: list[Source | None] = []
    mirror = env.get("FLEET_LAB_MIRROR")
    if not mirror:
        with contextlib.suppress(LabError):
            mirror = find_mirror(base.DEFAULT_SUITE)
    if mirror:
        sources.append(url_source(mirror, "apt mirror for debootstrap"))
    try:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    urls = pip_config_urls(listing)
    sources += [url_source(url, f"pip {key}") for key, url in urls]
    if not any(key == "index-url" for key, _ in urls):
        sources += [url_source(url, "pip's default index") for url in pip_default_index()]
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        if env.get(name):
            value = env[name] if "://" in env[name] else "http://" + env[name]
            sources.append(url_source(value, name))
    unique: dict[tuple[str, int], Source] = {}
    for s in sources:
        if s is not None:
            unique.setdefault((s.host, s.port), s)
    return list(unique.values())


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def machine_allowances() -> tuple[list[Allowance], list[str]]:
    """:func:`allowances` for this machine's package sources and nameservers."""
    try:
        resolv = Path("/etc/resolv.conf").read_text()
    except OSError:
        resolv = ""
    return allowances(package_sources(), parse_nameservers(resolv), resolve)


# -- reading the table ----------------------------------------------------------------------------

_NFT_CTX_OUTPUT_JSON = 1 << 4  # libnftables(3): nft_ctx_output_set_flags
_LIBNFTABLES: Any = None  # the loaded library and a context, or False where it cannot be loaded


def _libnftables_json(command: str) -> tuple[int, str, str] | None:
    """Run an nft command through libnftables (the library nft is built on; libnftables(3)) in
    this process, with JSON output: (rc, stdout, stderr), or None without the library.

    The test run reads the guard's table after every test; a ``nft`` process each time costs
    10-50 ms on a busy 2-core machine, the library call about a millisecond.
    """
    global _LIBNFTABLES
    if _LIBNFTABLES is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("nftables") or "libnftables.so.1")
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            ctx = lib.nft_ctx_new(0)
            if not ctx:
                raise OSError("nft_ctx_new failed")
            lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
            if lib.nft_ctx_buffer_output(ctx) != 0 or lib.nft_ctx_buffer_error(ctx) != 0:
                raise OSError("nft_ctx_buffer_output failed")
            _LIBNFTABLES = (lib, ctx)
        except (OSError, AttributeError):
            _LIBNFTABLES = False
    if _LIBNFTABLES is False:
        return None
    lib, ctx = _LIBNFTABLES
    rc = lib.nft_run_cmd_from_buffer(ctx, command.encode())
    out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
    err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
    return int(rc), out, err


# -- the guard ------------------------------------------------------------------------------------


def current_cgroup(pid: int | str = "self") -> Path | None:
    """The v2 cgroup ``pid`` is in, as a directory, or None without a v2 hierarchy."""
    root = airgap.cgroup2_root()
    if root is None:
        return None
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def _enter(cgroup: Path, pid: int) -> None:
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def sweep_stale(home: Path | None) -> list[str]:
    """Remove the tables (and, under ``home``, the cgroups) of guards whose process is gone."""
    removed = []
    listed = airgap.nft(None, "list", "tables")
    for line in listed.stdout.splitlines():
        m = re.fullmatch(rf"table inet {TABLE_PREFIX}(\d+)", line.strip())
        if m and not _pid_alive(int(m.group(1))):
            airgap.delete_table(m.group(0).split()[-1])
            removed.append(m.group(0).split()[-1])
    if home is not None:
        for stale in home.glob(f"{CGROUP_PREFIX}*"):
            pid = stale.name.removeprefix(CGROUP_PREFIX)
            if pid.isdigit() and not _pid_alive(int(pid)) and not cgroups.pids_in(stale):
                cgroups.rmdir_tree(stale)
    return removed


@dataclass
class Guard:
    """A guard that is up: its table and cgroup, and what it lets through beyond loopback."""

    table: str
    cgroup: Path
    home: Path
    pid: int
    allowed: list[Allowance]
    unresolved: list[str] = field(default_factory=list)
    _seen: dict[tuple[str, str, int], int] = field(default_factory=dict)
    _total_seen: int = 0

    def read(self) -> tuple[int, dict[tuple[str, str, int], int]]:
        """(packets refused in all, {destination: packets}) so far."""
        command = f"list table inet {self.table}"
        listed = _libnftables_json(command)
        if listed is None:  # no libnftables here: nft itself
            done = airgap.nft(None, "-j", *command.split())
            listed = (done.returncode, done.stdout, done.stderr)
        rc, out, err = listed
        if rc != 0:
            raise LabError(f"the network guard's table inet {self.table} is gone: {err.strip()[-300:]}")
        listing: dict[str, Any] = json.loads(out)
        return parse_listing(listing)

    def refusals(self) -> list[Refusal]:
        """Every destination refused since the guard went up."""
        return news({}, self.read()[1])

    def news(self) -> tuple[list[Refusal], int]:
        """What was refused since the last call: (destinations, packets in all).

        Packets can outnumber the destinations' when the set of destinations is full.
        """
        total, now = self.read()
        found = news(self._seen, now)
        packets = total - self._total_seen
        self._seen, self._total_seen = now, total
        return found, packets

    def describe(self) -> str:
        extra = "; ".join(str(a) for a in self.allowed) or "nothing"
        line = (
            f"cgroup {self.cgroup} in nft table inet {self.table}: connections outside 127.0.0.0/8 and ::1 "
            f"are refused and logged; also allowed (this machine's package sources): {extra}"
        )
        if self.unresolved:
            line += f"; not resolved, so not allowed: {'; '.join(self.unresolved)}"
        return line

    def down(self) -> None:
        """Move this process (and anything left in the guard's cgroup) back, delete the table and the cgroup."""
        try:
            for pid in [self.pid, *cgroups.pids_in(self.cgroup)]:
                with contextlib.suppress(OSError):
                    _enter(self.home, pid)
        finally:
            airgap.delete_table(self.table)
            cgroups.remove_tree(self.cgroup)


def unavailable() -> str | None:
    """Why the subprocess guard cannot go up here, or None."""
    if os.geteuid() != 0:
        return "not root (a cgroup and nftables rules need root)"
    why = airgap.unavailable()
    if why is not None:
        return why
    if current_cgroup() is None:
        return "this process's cgroup v2 cannot be read from /proc/self/cgroup"
    return None


def up(allowed: Sequence[Allowance] = (), unresolved: Sequence[str] = ()) -> Guard:
    """Move this process into a cgroup of its own and load the guard's table; ``GuardUnavailable`` says why not."""
    why = unavailable()
    if why is not None:
        raise GuardUnavailable(why)
    home = current_cgroup()
    assert home is not None
    sweep_stale(home)
    pid = os.getpid()
    table = table_name(pid)
    cgroup = home / f"{CGROUP_PREFIX}{pid}"
    try:
        cgroup.mkdir(exist_ok=True)
        _enter(cgroup, pid)
    except OSError as exc:
        cgroups.remove_tree(cgroup)
        raise GuardUnavailable(f"cannot move this process into a cgroup of its own under {home}: {exc}") from None
    guard = Guard(table, cgroup, home, pid, list(allowed), list(unresolved))
    path, level = airgap.cgroup_match(cgroup)
    done = airgap.nft(ruleset(table, path, level, allowed), "-f", "-")
    if done.returncode != 0:
        guard.down()
        raise GuardUnavailable(f"nft refused the guard's rules: {done.stderr.strip()[-500:]}")
    return guard


@contextlib.contextmanager
def guarded(what: str, out: Callable[[str], None] = print) -> Iterator[Guard | None]:
    """Run the body (a benchmark) under the guard; it fails when anything was refused.

    Without the guard (not root, no nft or cgroup v2) the body runs unguarded, and ``out`` says so.
    """
    try:
        guard = up(*machine_allowances())
    except GuardUnavailable as exc:
        out(f"net guard: {what} runs UNGUARDED: {exc}")
        yield None
        return
    out(f"net guard: {guard.describe()}")
    try:
        yield guard
    finally:
        refused = guard.refusals()
        guard.down()
    if refused:
        raise SystemExit(
            f"net guard: {what} connected outside loopback (refused): {', '.join(map(str, refused))}; "
            "tests and benchmarks reach only 127.0.0.0/8 and ::1"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fleetlab.netguard CMD [ARG...]``: run a command under the guard."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m fleetlab.netguard CMD [ARG...]  (runs CMD reaching only loopback; needs root)")
        return 2
    rc = 0
    with guarded(" ".join(args), out=lambda line: print(line, file=sys.stderr)):
        rc = subprocess.run(args, check=False).returncode
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

"""Fleet rules: hosts of one group that differ from the group's majority, named with what differs.

Hosts are compared with peers of the same inventory group, GPU model and kind (bare metal or
GPU passthrough VM): hosts of different models differ by design. A strict majority of at least
three hosts is needed to call one host odd.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from fleet.audit.findings import Finding, Severity
from fleet.audit.rules import host_sku
from fleet.facts.hostfacts import HostFacts
from fleet.topology import island_shape

MIN_PEERS = 3

#: What is compared, and how to read it from a host's facts.
ATTRIBUTES: dict[str, Callable[[HostFacts], str]] = {
    "driver": lambda f: f.driver_version or "?",
    "gpu count": lambda f: str(len(f.gpus)),
    "topology": island_shape,
    "firmware": lambda f: ",".join(sorted({g.vbios or "?" for g in f.gpus})),
    "vLLM": lambda f: f.packages.get("vllm") or "not installed",
}


def peer_key(group: str, facts: HostFacts) -> tuple[str, str, bool]:
    sku = host_sku(facts)
    return (group, sku.key if sku else "?", facts.passthrough)


def fleet_findings(facts: Mapping[str, HostFacts], groups: Mapping[str, Sequence[str]]) -> list[Finding]:
    """``facts``: probed hosts (status ok); ``groups``: group name -> host names."""
    out: list[Finding] = []
    seen: set[tuple[str, str, str]] = set()
    for group, members in sorted(groups.items()):
        buckets: dict[tuple[str, str, bool], list[str]] = {}
        for host in members:
            f = facts.get(host)
            if f is None or not f.ok:
                continue
            buckets.setdefault(peer_key(group, f), []).append(host)
        for (_, sku, _vm), hosts in buckets.items():
            if len(hosts) < MIN_PEERS:
                continue
            for attr, read in ATTRIBUTES.items():
                values = {h: read(facts[h]) for h in hosts}
                (common, n), *_ = Counter(values.values()).most_common(1)
                if n * 2 <= len(hosts):
                    continue
                for h, v in values.items():
                    if v != common and (h, attr, v) not in seen:
                        seen.add((h, attr, v))
                        out.append(
                            Finding(
                                f"fleet-{attr.lower().replace(' ', '-')}",
                                Severity.WARNING,
                                h,
                                f"{attr} {v}, while {n} of {len(hosts)} {sku} hosts in group {group} have {common}",
                                way_out="bring the host in line with its peers, or move it to its own group",
                            )
                        )
    return out

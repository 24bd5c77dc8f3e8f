"""What an instance spanning hosts needs and a single-host one does not, judged (pure).

For every multi-node instance of the fleet plan (``fleet.plan.multinode``: one pipeline stage per
host, vLLM 0.33's multiprocessing backend), from facts read on each of its nodes:

* **the same NVIDIA driver, vLLM release and GPUs** (model, count, memory) on every node: vLLM
  sizes every rank alike (one ``--tensor-parallel-size``; every rank takes the smallest rank's KV
  block count, ``get_kv_cache_configs`` in ``vllm/v1/core/kv_cache_planning.py``) and the nodes
  exchange tensors through NCCL, which both ends must speak alike. The driver and the GPUs come from
  the NVML probe, the release from the ``current`` link (``fleet.facts.releases``). Error: the
  instance named, each node with its value.
* **the rendezvous**: each worker node connects to the leader's ``--master-addr:--master-port``
  (torch.distributed's TCPStore, ``init_distributed_environment`` in
  ``vllm/distributed/parallel_state.py``). A connection that is refused counts as reachable: the
  leader's kernel answered, nothing listens there yet (before a deploy, or while stopped). A
  timeout, no route or a name that does not resolve is an error: the worker would wait for the
  store until vLLM gives up (``fleet.facts.node_network_probe`` says how each is told apart).
* **the interconnect**: an ACTIVE RDMA port (InfiniBand or RoCE, ``/sys/class/infiniband``) on
  every node, of one link layer; otherwise NCCL carries the traffic between the nodes over TCP
  sockets (a warning saying what that costs, :data:`TCP_COST`). Nodes with fewer active RDMA ports
  than their peers are a warning too: NCCL's traffic is only as fast as the slowest node's ports.
* **the MTU** of the path towards the leader (the route's, else its interface's) the same on
  every node: a warning naming each node's interface and MTU.

A node whose facts could not be read is left out of a comparison and said so (``multinode-unchecked``);
a host that cannot be reached at all already has its own finding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fleet.audit.findings import Finding, Severity
from fleet.facts.hostfacts import HostFacts
from fleet.facts.node_network import NodeNet
from fleet.facts.releases import ReleasesDict
from fleet.facts.runner import HostUnreachable

#: What traffic over TCP costs, with its public sources.
TCP_COST = (
    "NCCL then falls back to its IP socket transport (NCCL User Guide, Environment Variables, "
    "NCCL_IB_DISABLE: 'NCCL will fall back to using IP sockets'): every transfer between the nodes "
    "is staged through host memory by CPU proxy threads, without GPUDirect RDMA (NCCL_NET_GDR_LEVEL "
    "applies to IB/RoCE only), at what the TCP interface sustains; with one pipeline stage per host "
    "each generated token waits for every stage's activations (hidden size × 2 bytes per token in "
    "flight) to cross that path"
)
NO_NODE = "-"


@dataclass(frozen=True)
class SpanningInstance:
    """A multi-node instance as the audit checks it: its nodes (rank order: the leader first) and
    the leader's rendezvous."""

    name: str  #: ``leader/vllm-N``
    nodes: tuple[str, ...]
    master_address: str
    master_port: int

    @property
    def leader(self) -> str:
        return self.nodes[0]

    def node(self, host: str) -> str:
        """``n2 (node 1)``; the leader: ``n1 (node 0, leader)``."""
        rank = self.nodes.index(host)
        return f"{host} (node {rank}{', leader' if rank == 0 else ''})"


@dataclass(frozen=True)
class NodeFacts:
    """What was read on one node (each part: its value, or why it could not be read; None: not asked)."""

    host: HostFacts | HostUnreachable | None = None
    releases: ReleasesDict | HostUnreachable | None = None
    net: NodeNet | HostUnreachable | None = None


# -- what is compared -----------------------------------------------------------------------------------


def driver_of(f: HostFacts) -> str:
    return f.driver_version or "unknown"


def gpus_of(f: HostFacts) -> str:
    """``8 × NVIDIA H100 80GB HBM3 (81559 MiB)``; hosts with mixed GPUs list each kind."""
    kinds = Counter(
        f"{g.name or '?'} ({g.memory.total // 2**20} MiB)" if g.memory is not None else f"{g.name or '?'} (? MiB)"
        for g in f.gpus
    )
    return " + ".join(f"{n} × {kind}" for kind, n in sorted(kinds.items())) if kinds else "no GPU"


def release_of(r: ReleasesDict) -> str:
    return r["current"] or "none installed"


def _values(
    inst: SpanningInstance, nodes: Mapping[str, NodeFacts], read: Callable[[NodeFacts], str | None]
) -> dict[str, str]:
    out = {}
    for host in inst.nodes:
        value = read(nodes.get(host, NodeFacts()))
        if value is not None:
            out[host] = value
    return out


def _differ(inst: SpanningInstance, rule: str, what: str, values: Mapping[str, str], way_out: str) -> list[Finding]:
    if len(set(values.values())) <= 1:
        return []
    said = "; ".join(f"{inst.node(h)} {v}" for h, v in values.items())
    return [
        Finding(
            rule,
            Severity.ERROR,
            inst.leader,
            f"instance {inst.name}: {what} differs across its nodes: {said}",
            way_out=way_out,
            instance=inst.name,
        )
    ]


def _host(n: NodeFacts) -> HostFacts | None:
    return n.host if isinstance(n.host, HostFacts) and n.host.ok else None


def rule_same_driver(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    values = _values(inst, nodes, lambda n: driver_of(f) if (f := _host(n)) is not None else None)
    return _differ(inst, "multinode-driver", "the NVIDIA driver", values,
                   "install one driver version on every node (nvidia_driver_version for the group), then restart "
                   "the instance")  # fmt: skip


def rule_same_gpus(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    values = _values(inst, nodes, lambda n: gpus_of(f) if (f := _host(n)) is not None else None)
    return _differ(inst, "multinode-gpus", "the GPUs (model, count, memory)", values,
                   "vLLM sizes every rank alike: replace the odd host, or move it to a group of its own")  # fmt: skip


def rule_same_release(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    values = _values(inst, nodes, lambda n: release_of(n.releases) if isinstance(n.releases, dict) else None)
    return _differ(inst, "multinode-release", "the vLLM release (current)", values,
                   "deploy again: every node of an instance runs one release (fleet deploy INVENTORY)")  # fmt: skip


def _net(n: NodeFacts) -> NodeNet | None:
    return n.net if isinstance(n.net, NodeNet) and n.net.ok else None


def rule_rendezvous(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    """Each worker's connect to the leader's rendezvous: refused is reachable; anything else is not."""
    out = []
    target = f"{inst.master_address}:{inst.master_port}"
    for host in inst.nodes[1:]:
        net = _net(nodes.get(host, NodeFacts()))
        if net is None or net.connect is None or net.connect.reachable:
            continue
        c = net.connect
        why = {
            "timeout": "no answer (packets dropped: a firewall, or the leader is down or not at that address)",
            "unreachable": "no route to it",
            "unresolved": "the name does not resolve there",
        }.get(c.outcome, c.outcome)
        out.append(
            Finding(
                "multinode-rendezvous", Severity.ERROR, host,
                f"instance {inst.name}: {inst.node(host)} cannot reach the leader {inst.leader}'s rendezvous "
                f"{target} (--master-addr/--master-port): {why}: {c.error}",
                way_out=f"let {host} open TCP connections to {target}, and to the leader's other ports (vLLM's "
                "message queues bind ports of their own, NCCL opens more: NCCL docs, Troubleshooting, IP ports); "
                f"or make {inst.master_address} an address of {inst.leader} that {host} reaches (inventory "
                "ssh_hostname or bind_address)",
                instance=inst.name,
            )
        )  # fmt: skip
    return out


def _rdma_said(net: NodeNet) -> str:
    if not net.rdma_present:
        return "no RDMA device (/sys/class/infiniband)"
    if not net.rdma:
        return f"RDMA devices without readable ports ({net.rdma_error or 'no ports'})"
    return ", ".join(p.describe() for p in net.rdma)


def rule_interconnect(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    """An ACTIVE RDMA port of one link layer on every node, else the TCP warning; fewer active
    ports on some node than on another: a warning."""
    nets = {h: n for h in inst.nodes if (n := _net(nodes.get(h, NodeFacts()))) is not None}
    if len(nets) < 2:
        return []
    layers = [{p.link_layer for p in n.active_rdma} for n in nets.values()]
    common = set.intersection(*layers)
    if not common:
        said = "; ".join(f"{inst.node(h)}: {_rdma_said(n)}" for h, n in nets.items())
        mixed = all(layers)
        return [
            Finding(
                "multinode-tcp", Severity.WARNING, inst.leader,
                f"instance {inst.name}: traffic between its nodes goes over TCP: "
                + ("their active RDMA ports share no link layer (InfiniBand cannot talk to RoCE)" if mixed
                   else "not every node has an ACTIVE RDMA port")
                + f" ({said}). {TCP_COST}",
                way_out="give every node an ACTIVE InfiniBand or RoCE port of one kind (ibstat: State Active; "
                "cable, subnet manager, driver), or accept the cost: it is latency per token, the model still serves",
                instance=inst.name,
            )
        ]  # fmt: skip
    counts = {h: sum(1 for p in n.active_rdma if p.link_layer in common) for h, n in nets.items()}
    if len(set(counts.values())) <= 1:
        return []
    most = max(counts.values())
    said = "; ".join(f"{inst.node(h)}: {counts[h]} active ({_rdma_said(n)})" for h, n in nets.items())
    return [
        Finding(
            "multinode-rdma-ports", Severity.WARNING, inst.leader,
            f"instance {inst.name}: its nodes have different numbers of ACTIVE RDMA ports ({said}); NCCL's "
            f"traffic between the nodes goes as fast as the node with the fewest",
            way_out=f"bring the ports that are not ACTIVE up (ibstat; cable, switch port) so every node has {most}",
            instance=inst.name,
        )
    ]  # fmt: skip


def rule_mtu(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    """The MTU towards the leader (route, else interface) the same on every node."""
    values: dict[str, tuple[int, str]] = {}
    for h in inst.nodes:
        net = _net(nodes.get(h, NodeFacts()))
        if net is None or net.route is None or (mtu := net.route.effective_mtu) is None:
            continue
        r = net.route
        where = f"{r.dev or '?'}" + (" route" if r.route_mtu is not None else "")
        values[h] = (mtu, where)
    if len({m for m, _ in values.values()}) <= 1:
        return []
    said = "; ".join(f"{inst.node(h)} {where} MTU {mtu}" for h, (mtu, where) in values.items())
    return [
        Finding(
            "multinode-mtu", Severity.WARNING, inst.leader,
            f"instance {inst.name}: the MTU towards the leader differs across its nodes: {said}; frames larger than "
            "the smallest are dropped on the way, which stalls NCCL and RoCE traffic rather than failing it",
            way_out="set one MTU on the interfaces that connect the nodes (and the switch ports between them)",
            instance=inst.name,
        )
    ]  # fmt: skip


def rule_unchecked(inst: SpanningInstance, nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    """Nodes that answered the NVML probe but whose release or network facts could not be read."""
    out = []
    for h in inst.nodes:
        n = nodes.get(h, NodeFacts())
        if _host(n) is None:
            continue  # the host's own finding says why
        missing = []
        if isinstance(n.releases, HostUnreachable):
            missing.append(f"release ({n.releases.reason})")
        if isinstance(n.net, HostUnreachable):
            missing.append(f"network ({n.net.reason})")
        elif isinstance(n.net, NodeNet):
            if not n.net.ok:
                missing.append(f"network ({n.net.status}: {n.net.error})")
            elif n.net.route is not None and n.net.route.error:
                missing.append(f"MTU ({n.net.route.error})")
        if missing:
            out.append(
                Finding(
                    "multinode-unchecked", Severity.WARNING, h,
                    f"instance {inst.name}: {inst.node(h)} could not be checked for: {'; '.join(missing)}",
                    way_out="make python3 and iproute2 (ip) available on the host, then audit again",
                    instance=inst.name,
                )
            )  # fmt: skip
    return out


RULES: tuple[Callable[[SpanningInstance, Mapping[str, NodeFacts]], list[Finding]], ...] = (
    rule_same_driver,
    rule_same_gpus,
    rule_same_release,
    rule_rendezvous,
    rule_interconnect,
    rule_mtu,
    rule_unchecked,
)


def multi_node_findings(instances: Sequence[SpanningInstance], nodes: Mapping[str, NodeFacts]) -> list[Finding]:
    """Every rule over every instance spanning hosts; ``nodes``: host -> what was read on it."""
    return [f for inst in instances for rule in RULES for f in rule(inst, nodes)]


def unplanned_finding(host: str, group: str, why: str) -> Finding:
    """A ``multi_node`` group whose hosts form no instance, although the model fits none of them alone."""
    return Finding(
        "multinode-unplanned", Severity.ERROR, host,
        f"multi_node {group}: its hosts form no instance: {why}",
        way_out="fleet plan INVENTORY shows the refusal with its ways out",
    )  # fmt: skip

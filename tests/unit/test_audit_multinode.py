"""The multi-node audit rules (``fleet.audit.multinode``), table-tested on recorded fact output
(NVML probe fixtures, the release fact's dict, the network probe's JSON) with one value changed
per row; and how ``fleet audit`` finds the instances in the fleet plan (``fleet.audit.run``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.audit.findings import Finding, Severity
from fleet.audit.multinode import NodeFacts, SpanningInstance, multi_node_findings
from fleet.audit.run import MultiNode, judge, plan_multi_node
from fleet.facts.hostfacts import HostFacts, parse_probe
from fleet.facts.node_network import NodeNet, parse_node_network
from fleet.facts.releases import ReleasesDict
from fleet.facts.runner import HostUnreachable
from fleet.inventory.spec import load_inventory

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"
INST = SpanningInstance("n1/vllm-0", ("n1", "n2"), "127.0.250.3", 29501)
THREE = SpanningInstance("n1/vllm-0", ("n1", "n2", "n3"), "127.0.250.3", 29501)
RELEASE = "vllm-0.33.0-py3.11.2-0123abcd4567"


def host(name: str = "h100-sxm-1-passthrough", change: Callable[[dict[str, Any]], object] | None = None) -> HostFacts:
    d: dict[str, Any] = json.loads(json.loads((FIXTURES / f"{name}.json").read_text())["output"][-1])
    if change is not None:
        change(d)
    return parse_probe(d)


def releases(current: str | None = RELEASE) -> ReleasesDict:
    return {
        "releases": [{"name": RELEASE, "mtime": 1790000000, "complete": True}],
        "current": current,
        "previous": None,
    }


# The network probe's answer on a worker (recorded on loopback), and on the leader (no connect).
WORKER = {
    "schema": 1, "status": "ok", "error": None, "address": "127.0.250.3", "resolved": "127.0.250.3",
    "connect": {"port": 29501, "outcome": "refused", "errno": 111, "error": "Connection refused", "seconds": 0.0},
    "route": {"dev": "eth0", "src": "127.0.250.4", "type": "unicast", "mtu": 9000, "route_mtu": None, "error": None},
    "rdma": {"present": True, "error": None, "ports": [
        {"device": "mlx5_0", "port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"},
    ]},
}  # fmt: skip


def net(leader: bool = False, **changes: Any) -> NodeNet:
    d = json.loads(json.dumps(WORKER))
    if leader:
        d["connect"] = None
        d["route"].update(type="local", src="127.0.250.3")
    for key, value in changes.items():
        part, _, field = key.partition("__")
        if field:
            d[part][field] = value
        else:
            d[part] = value
    return parse_node_network([json.dumps(d)])


def ok_nodes(hosts: tuple[str, ...] = ("n1", "n2")) -> dict[str, NodeFacts]:
    return {h: NodeFacts(host(), releases(), net(leader=i == 0)) for i, h in enumerate(hosts)}


def with_node(nodes: dict[str, NodeFacts], name: str, **parts: Any) -> dict[str, NodeFacts]:
    old = nodes[name]
    return {**nodes, name: NodeFacts(parts.get("host", old.host), parts.get("releases", old.releases),
                                     parts.get("net", old.net))}  # fmt: skip


def findings(nodes: dict[str, NodeFacts], inst: SpanningInstance = INST) -> set[tuple[str, str, str]]:
    return {(f.rule, f.severity.label, f.host) for f in multi_node_findings([inst], nodes)}


def drv(version: str) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        d["driver_version"] = version

    return change


IB_DOWN = [
    {"device": "mlx5_0", "port": 1, "state": "1: DOWN", "link_layer": "InfiniBand", "rate": "10 Gb/sec (4X SDR)"}
]
ROCE = [{"device": "mlx5_0", "port": 1, "state": "4: ACTIVE", "link_layer": "Ethernet", "rate": "200 Gb/sec (4X HDR)"}]
TWO_IB = [
    {"device": "mlx5_0", "port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"},
    {"device": "mlx5_1", "port": 1, "state": "4: ACTIVE", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"},
]
NO_RDMA = {"present": False, "ports": [], "error": None}

# (what differs on n2, findings)
TABLE: list[tuple[str, dict[str, Any], set[tuple[str, str, str]]]] = [
    ("nothing", {}, set()),
    ("driver", {"host": host(change=drv("575.57.08"))}, {("multinode-driver", "error", "n1")}),
    ("GPU model", {"host": host("h200-sxm-1-passthrough")}, {("multinode-gpus", "error", "n1")}),
    ("release", {"releases": releases("vllm-0.32.0-py3.11.2-89abcdef0123")}, {("multinode-release", "error", "n1")}),
    ("no release yet", {"releases": releases(None)}, {("multinode-release", "error", "n1")}),
    ("rendezvous dropped", {"net": net(connect__outcome="timeout", connect__errno=None, connect__error="no answer within 3 s")}, {("multinode-rendezvous", "error", "n2")}),
    ("no route", {"net": net(connect__outcome="unreachable", connect__errno=113, connect__error="No route to host")}, {("multinode-rendezvous", "error", "n2")}),
    ("rendezvous open (leader up)", {"net": net(connect__outcome="open", connect__errno=None, connect__error="")}, set()),
    ("no RDMA device", {"net": net(rdma=NO_RDMA)}, {("multinode-tcp", "warning", "n1")}),
    ("RDMA port down", {"net": net(rdma={"present": True, "ports": IB_DOWN, "error": None})}, {("multinode-tcp", "warning", "n1")}),
    ("RoCE against InfiniBand", {"net": net(rdma={"present": True, "ports": ROCE, "error": None})}, {("multinode-tcp", "warning", "n1")}),
    ("more active ports", {"net": net(rdma={"present": True, "ports": TWO_IB, "error": None})}, {("multinode-rdma-ports", "warning", "n1")}),
    ("MTU", {"net": net(route__mtu=1500)}, {("multinode-mtu", "warning", "n1")}),
    ("route MTU", {"net": net(route__route_mtu=1500)}, {("multinode-mtu", "warning", "n1")}),
    ("no python3", {"net": parse_node_network(['{"schema": 1, "status": "no-python", "error": "no python3 on the host"}'])}, {("multinode-unchecked", "warning", "n2")}),
    ("no ip", {"net": net(route__error="no ip here (iproute2)", route__mtu=None, route__dev=None)}, {("multinode-unchecked", "warning", "n2")}),
    ("release fact failed", {"releases": HostUnreachable("n2", "fact command exited 1: x")}, {("multinode-unchecked", "warning", "n2")}),
    # a host that does not answer at all has its own finding; nothing is compared with it
    ("unreachable", {"host": HostUnreachable("n2", "timed out"), "releases": HostUnreachable("n2", "timed out"),
                     "net": HostUnreachable("n2", "timed out")}, set()),
]  # fmt: skip


@pytest.mark.parametrize(("what", "n2", "expected"), TABLE, ids=[t[0] for t in TABLE])
def test_rules(what: str, n2: dict[str, Any], expected: set[tuple[str, str, str]]) -> None:
    assert findings(with_node(ok_nodes(), "n2", **n2)) == expected


def one(nodes: dict[str, NodeFacts], inst: SpanningInstance = INST) -> Finding:
    (found,) = multi_node_findings([inst], nodes)
    return found


def test_a_difference_names_the_instance_the_nodes_and_their_values() -> None:
    f = one(with_node(ok_nodes(), "n2", host=host(change=drv("575.57.08"))))
    assert f.instance == "n1/vllm-0" and f.where == "n1 instance n1/vllm-0"
    assert "instance n1/vllm-0: the NVIDIA driver differs across its nodes" in f.message
    assert "n1 (node 0, leader) 580.159.04; n2 (node 1) 575.57.08" in f.message
    g = one(with_node(ok_nodes(), "n2", releases=releases("vllm-0.32.0-py3.11.2-89abcdef0123")))
    assert f"n1 (node 0, leader) {RELEASE}; n2 (node 1) vllm-0.32.0-py3.11.2-89abcdef0123" in g.message
    gpus = [x for x in multi_node_findings([INST], with_node(ok_nodes(), "n2", host=host("h200-sxm-1-passthrough")))
            if x.rule == "multinode-gpus"]  # fmt: skip
    assert "1 × NVIDIA H100 80GB HBM3 (81559 MiB)" in gpus[0].message and "NVIDIA H200" in gpus[0].message


def test_the_odd_node_of_three_is_named_with_the_others() -> None:
    nodes = with_node(ok_nodes(("n1", "n2", "n3")), "n3", net=net(route__mtu=1500))
    f = one(nodes, THREE)
    assert f.rule == "multinode-mtu"
    assert "n1 (node 0, leader) eth0 MTU 9000; n2 (node 1) eth0 MTU 9000; n3 (node 2) eth0 MTU 1500" in f.message


def test_rendezvous_says_how_it_failed_and_the_way_out() -> None:
    f = one(with_node(ok_nodes(), "n2", net=net(connect__outcome="timeout", connect__error="no answer within 3 s")))
    assert f.host == "n2" and "n2 (node 1) cannot reach the leader n1's rendezvous 127.0.250.3:29501" in f.message
    assert "packets dropped" in f.message and "no answer within 3 s" in f.message
    assert "NCCL" in f.way_out and "127.0.250.3:29501" in f.way_out


def test_tcp_says_what_it_costs_with_its_source() -> None:
    f = one(with_node(ok_nodes(), "n2", net=net(rdma=NO_RDMA)))
    assert "traffic between its nodes goes over TCP" in f.message
    assert "n2 (node 1): no RDMA device (/sys/class/infiniband)" in f.message
    assert "n1 (node 0, leader): mlx5_0 port 1 ACTIVE (InfiniBand, 400 Gb/sec (4X NDR))" in f.message
    assert "NCCL_IB_DISABLE" in f.message and "host memory" in f.message
    # every node on TCP alike is still TCP: said once
    both = {h: NodeFacts(host(), releases(), net(leader=h == "n1", rdma=NO_RDMA)) for h in ("n1", "n2")}
    assert findings(both) == {("multinode-tcp", "warning", "n1")}


def test_a_finding_about_an_instance_carries_it_in_json_and_a_hosts_does_not() -> None:
    f = one(with_node(ok_nodes(), "n2", net=net(route__mtu=1500)))
    assert f.to_json()["instance"] == "n1/vllm-0"
    assert "instance" not in Finding("x", Severity.ERROR, "h", "m").to_json()


# -- the instances, from the fleet plan -------------------------------------------------------------

WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}


def inventory(tmp_path: Path, model: str, weights: str, extra: str = "") -> Path:
    rows = [(h, {"ssh_hostname": f"127.0.250.{3 + i}"}) for i, h in enumerate(("n1", "n2"))]
    data = {"model": model, "weights": weights, "multi_node": True, "gpu": {"sku": "h100-sxm-80gb", "count": 1}}
    path = tmp_path / "fleet.py"
    path.write_text(f"W = {WORKLOAD!r}\npair = ({rows!r}, dict(workload=W, **{data!r}))\n{extra}")
    return path


L70 = "meta-llama/Llama-3.1-70B-Instruct"


def test_the_plans_instance_spanning_hosts_is_audited(tmp_path: Path) -> None:
    loaded = load_inventory(inventory(tmp_path, L70, "fp8"))
    probed: dict[str, HostFacts | HostUnreachable] = {"n1": host(), "n2": host()}
    instances, unplanned = plan_multi_node(loaded, probed)
    assert instances == [SpanningInstance("n1/vllm-0", ("n1", "n2"), "127.0.250.3", 29501)] and unplanned == []


def test_nodes_whose_probed_gpus_differ_are_audited_as_the_inventory_means_them(tmp_path: Path) -> None:
    """The plan from the probe refuses hosts with different GPUs; the audit still checks the
    instance the inventory declares, and says what differs."""
    loaded = load_inventory(inventory(tmp_path, L70, "fp8"))
    probed: dict[str, HostFacts | HostUnreachable] = {"n1": host(), "n2": host("h200-sxm-1-passthrough")}
    instances, _ = plan_multi_node(loaded, probed)
    assert [i.nodes for i in instances] == [("n1", "n2")]
    nodes = {h: NodeFacts(probed[h], releases(), net(leader=h == "n1")) for h in ("n1", "n2")}
    assert ("multinode-gpus", "error", "n1") in findings(nodes, instances[0])


def test_a_multi_node_group_that_forms_no_instance_is_said(tmp_path: Path) -> None:
    loaded = load_inventory(inventory(tmp_path, "meta-llama/Llama-3.1-405B-Instruct", "bf16"))
    instances, unplanned = plan_multi_node(loaded, {"n1": host(), "n2": host()})
    assert instances == []
    assert [(f.rule, f.severity, f.host) for f in unplanned] == [("multinode-unplanned", Severity.ERROR, "n1")]
    assert "group pair" in unplanned[0].message and "does not fit" in unplanned[0].message


def test_single_host_inventories_plan_nothing_and_judge_as_before(tmp_path: Path) -> None:
    path = tmp_path / "fleet.py"
    path.write_text(
        f"W = {WORKLOAD!r}\nsolo = ([('s1', {{'ssh_hostname': '127.0.250.9'}})], "
        "dict(workload=W, model='meta-llama/Llama-3.1-8B-Instruct', gpu={'sku': 'h100-sxm-80gb', 'count': 1}))\n"
    )
    loaded = load_inventory(path)
    assert plan_multi_node(loaded, {"s1": host()}) == ([], [])
    before = judge(loaded, {"s1": host()}).to_json()
    after = judge(loaded, {"s1": host()}, spanning=MultiNode([])).to_json()
    assert before == after and all("instance" not in f for h in before["hosts"] for f in h["findings"])


def test_judge_puts_the_multi_node_findings_beside_the_fleet_findings(tmp_path: Path) -> None:
    loaded = load_inventory(inventory(tmp_path, L70, "fp8"))
    probed: dict[str, HostFacts | HostUnreachable] = {"n1": host(), "n2": host(change=drv("575.57.08"))}
    instances, unplanned = plan_multi_node(loaded, probed)
    spanning = MultiNode(instances, unplanned, {"n1": releases(), "n2": releases()},
                         {"n1": net(leader=True), "n2": net(rdma=NO_RDMA)})  # fmt: skip
    report = judge(loaded, probed, spanning=spanning).to_json()
    rules = {(f["rule"], f["host"], f.get("instance")) for f in report["fleet_findings"]}
    assert rules == {("multinode-driver", "n1", "n1/vllm-0"), ("multinode-tcp", "n1", "n1/vllm-0")}
    n1 = next(h for h in report["hosts"] if h["host"] == "n1")
    assert {f["rule"] for f in n1["findings"]} >= {"multinode-driver", "multinode-tcp"}


def test_html_lists_them_under_their_own_heading_escaped(tmp_path: Path) -> None:
    loaded = load_inventory(inventory(tmp_path, L70, "fp8"))
    probed: dict[str, HostFacts | HostUnreachable] = {"n1": host(), "n2": host()}
    instances, _ = plan_multi_node(loaded, probed)
    spanning = MultiNode(instances, [], {"n1": releases(), "n2": releases()},
                         {"n1": net(leader=True), "n2": net(route__mtu=1500, route__dev="<b>eth9")})  # fmt: skip
    page = judge(loaded, probed, spanning=spanning).to_html()
    assert "<h3>instances spanning hosts</h3>" in page and "hosts that differ from their peers" not in page
    assert "&lt;b&gt;eth9 MTU 1500" in page and "<b>eth9" not in page
    assert "instances spanning hosts" not in judge(loaded, probed).to_html()

"""``fleet status`` of an instance spanning hosts: one row at its leader (HTTP asks the leader only),
every node's unit from its own host, a node down as the instance down naming the node, and --json
with the nodes; a single-host row reads as before."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from fleet.cli.status_view import host_cell, status_view
from fleet.facts.drain import DrainMarker
from fleet.facts.hoststatus import HostStatusProbe
from fleet.facts.runner import HostUnreachable
from fleet.inventory.spec import LoadedInventory
from fleet.monitor.hoststate import ssh_targets, unit_facts
from fleet.monitor.metric_names import names_for
from fleet.monitor.status import (
    Health,
    InstanceStatus,
    NodeState,
    State,
    UnitFacts,
    attach_host_state,
    attach_units,
    from_scrapes,
    state_of,
    status_data,
)
from fleet.monitor.targets import Target, targets_from_outcomes
from fleet.monitor.thresholds import Thresholds
from fleet.plan.outcomes import FleetPlan, build_fleet_plan, load_for_planning

from .test_units_fact import RECORDED

WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}
SPAN = Target("n1", "pair", "m", 0, "127.0.250.3", 8000, "0.33.0", (0,), nodes=("n1", "n2", "n3"))
SOLO = Target("s1", "solo", "m", 0, "127.0.250.9", 8000, "0.33.0", (0,))


def unit(state: str = "active/running", restarts: int | None = 0, detail: str = "") -> UnitFacts:
    return UnitFacts(state, 60.0 if state.startswith("active") else None, restarts, None, None, detail=detail)


def row(health: Health, units: dict[str, UnitFacts], target: Target = SPAN) -> InstanceStatus:
    base = from_scrapes(target, health, "", None, None, None, names_for("0.33.0", target.host), Thresholds())
    return attach_units([base], units)[0]


def fleet_plan(tmp_path: Path) -> tuple[LoadedInventory, FleetPlan]:
    rows = [(h, {"ssh_hostname": f"127.0.250.{3 + i}"}) for i, h in enumerate(("n1", "n2"))]
    data = {"model": "meta-llama/Llama-3.1-70B-Instruct", "weights": "fp8", "multi_node": True,
            "gpu": {"sku": "h100-sxm-80gb", "count": 1}}  # fmt: skip
    path = tmp_path / "fleet.py"
    path.write_text(f"W = {WORKLOAD!r}\npair = ({rows!r}, dict(workload=W, **{data!r}))\n")
    loaded = load_for_planning(path)
    return loaded, build_fleet_plan(loaded)


def test_one_target_at_the_leader_with_its_nodes(tmp_path: Path) -> None:
    loaded, plan = fleet_plan(tmp_path)
    (t,) = targets_from_outcomes(plan.outcomes, loaded)
    assert (t.host, t.instance, t.address, t.port, t.nodes) == ("n1", "n1/vllm-0", "127.0.250.3", 8000, ("n1", "n2"))
    assert t.url == "http://127.0.250.3:8000"  # the leader's API: the headless node serves none
    assert {s.name for s in ssh_targets(loaded.pyinfra, [t])} == {"n1", "n2"}  # every node's units are read


def test_every_nodes_unit_is_read_from_its_own_host() -> None:
    answer = HostStatusProbe().process(RECORDED)  # a lab host: fleet-vllm-0 running
    got = unit_facts([SPAN], {"n1": answer, "n2": answer, "n3": HostUnreachable("n3", "timed out")})
    assert got["n1/vllm-0"].state == got["n2/vllm-0"].state == "active/running"
    assert (got["n3/vllm-0"].state, got["n3/vllm-0"].detail) == ("unreachable", "timed out")
    assert set(unit_facts([SOLO], {"s1": answer})) == {"s1/vllm-0"}  # one host: as before


@pytest.mark.parametrize(
    ("health", "leader", "state"),
    [
        (Health.READY, "active/running", State.NODE_DOWN),  # the leader answers 200 a moment longer
        (Health.NOT_LISTENING, "active/running", State.NODE_DOWN),  # would be "loading": waits for the node
        (Health.ENGINE_DEAD, "active/running", State.NODE_DOWN),
        (Health.NOT_LISTENING, "activating/auto-restart", State.NODE_DOWN),
        (Health.NOT_LISTENING, "failed/failed", State.FAILED),  # the leader's own word says more
        (Health.NOT_LISTENING, "inactive/dead", State.STOPPED),
        (Health.READY, "deactivating/stop-sigterm", State.STOPPING),
        (Health.UNREACHABLE, "unreachable", State.UNREACHABLE),
    ],
)
def test_a_node_down_is_the_instance_down(health: Health, leader: str, state: State) -> None:
    assert state_of(health, unit(leader), node_down=True) is state
    assert state_of(health, unit(leader), drained=True, node_down=True) is State.DRAINED


@pytest.mark.parametrize(
    ("n2", "n3", "state", "problems"),
    [
        (unit(), unit(), State.READY, []),
        (unit("failed/failed"), unit(), State.NODE_DOWN,
         ["node 1 (n2) down: unit fleet-vllm-0.service is failed/failed"]),
        (unit(), unit("unreachable", None, "timed out"), State.NODE_DOWN,
         ["node 2 (n3) down: host unreachable over SSH: timed out"]),
        (unit("inactive/dead"), unit("not installed", None), State.NODE_DOWN,
         ["node 1 (n2) down: unit fleet-vllm-0.service is inactive/dead",
          "node 2 (n3) down: unit fleet-vllm-0.service is not installed"]),
        (unit(restarts=9), unit(), State.READY, ["node 1 (n2): unit restarted 9 times"]),
    ],
)  # fmt: skip
def test_rows(n2: UnitFacts, n3: UnitFacts, state: State, problems: list[str]) -> None:
    r = row(Health.READY, {"n1/vllm-0": unit(), "n2/vllm-0": n2, "n3/vllm-0": n3})
    assert r.state is state and list(r.problems) == problems and r.ok is (not problems)
    assert [(n.host, n.rank) for n in r.nodes] == [("n1", 0), ("n2", 1), ("n3", 2)]


def test_without_ssh_facts_the_nodes_are_listed_and_not_called_down() -> None:
    base = from_scrapes(SPAN, Health.READY, "", None, None, None, names_for("0.33.0", "n1"), Thresholds())
    assert [n.unit for n in base.nodes] == [None, None, None] and base.state is State.READY and base.ok


def test_a_drained_node_drains_the_instance() -> None:
    r = row(Health.NOT_LISTENING, {"n1/vllm-0": unit(), "n2/vllm-0": unit("inactive/dead"), "n3/vllm-0": unit()})
    marker = DrainMarker(by="ops@desk", at=1790000000.0, reason="new cable", instances=("vllm-0",))
    (drained,) = attach_host_state([r], {"n2": marker}, {})
    assert drained.state is State.DRAINED and drained.ok


def test_json_carries_the_nodes_and_a_single_host_row_reads_as_before() -> None:
    r = row(Health.READY, {"n1/vllm-0": unit(), "n2/vllm-0": unit("failed/failed"), "n3/vllm-0": unit()})
    data = status_data(r)
    assert data["state"] == "node down" and data["instance"] == "n1/vllm-0"
    nodes = [(n["host"], n["rank"], n["leader"], n["headless"], n["down"], n["unit"]["state"]) for n in data["nodes"]]
    assert nodes == [
        ("n1", 0, True, False, False, "active/running"),
        ("n2", 1, False, True, True, "failed/failed"),
        ("n3", 2, False, True, False, "active/running"),
    ]  # fmt: skip
    solo = status_data(row(Health.READY, {"s1/vllm-0": unit()}, SOLO))
    assert "nodes" not in solo and list(solo)[-1] == "ok"


def render(rows: list[InstanceStatus]) -> str:
    console = Console(width=100, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    console.print(status_view(rows, 2.0))
    return console.export_text()


def test_one_row_with_its_nodes_leader_first_and_the_down_node_named() -> None:
    r = row(Health.READY, {"n1/vllm-0": unit(), "n2/vllm-0": unit("failed/failed"), "n3/vllm-0": unit()})
    cell = host_cell(r)
    assert not isinstance(cell, str) and cell.plain == "n1\nn2\nn3"
    assert [s.style for s in cell.spans if s.style] == ["red"]  # n2
    text = render([r, row(Health.READY, {"s1/vllm-0": unit()}, SOLO)])
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("n1"))
    assert "node down" in lines[first] and lines[first + 1].strip() == "n2" and lines[first + 2].strip() == "n3"
    assert "n1/vllm-0: node 1 (n2) down: unit fleet-vllm-0.service is failed/failed" in " ".join(text.split())
    assert host_cell(row(Health.READY, {}, SOLO)) == "s1"


def test_node_state_down_needs_facts() -> None:
    assert not NodeState("n2", 1).down
    assert NodeState("n2", 1, unit("inactive/dead")).down and not NodeState("n2", 1, unit()).down
    assert replace(SPAN, nodes=()).node_hosts == ("n1",)


def test_a_quarantined_gpu_on_a_worker_node_is_a_problem_of_the_instance() -> None:
    from .test_status_quarantine import RECORD  # GPU 2 quarantined after XID 79

    span = replace(SPAN, gpus=(2,))
    r = row(Health.READY, {h: unit() for h in ("n1/vllm-0", "n2/vllm-0", "n3/vllm-0")}, span)
    (got,) = attach_host_state([r], {}, {}, watch={"n3": RECORD})
    assert got.quarantine == () and [len(n.quarantine) for n in got.nodes] == [0, 0, 1]
    (problem,) = got.problems
    assert problem.startswith("node 2 (n3): GPU 2 quarantined since ") and "fleet gpu clear INVENTORY n3 2" in problem
    assert status_data(got)["nodes"][2]["quarantine"][0]["gpu"] == 2 and not got.ok

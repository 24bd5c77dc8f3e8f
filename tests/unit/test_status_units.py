"""``fleet status``'s SSH side: each host's units + NVML answer merged into per-instance rows (pure),
and the rows' problems and ``--json`` once the facts are in."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fleet.facts.hostfacts import GpuProcess, HostFacts
from fleet.facts.hoststatus import HostStatus, HostStatusProbe
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable
from fleet.facts.units import process_units
from fleet.monitor.hoststate import gpu_memory_of, unit_facts
from fleet.monitor.status import Health, InstanceStatus, UnitFacts, attach_units, status_data
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds

from .test_units_fact import RECORDED, RELEASE, UNITS_PART

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"
GiB = 2**30


def rtx4090_2(procs: dict[int, list[GpuProcess]] | None) -> HostFacts:
    """The lab's recorded 2x RTX 4090 probe, with these processes per GPU (None: NVML refused)."""
    facts = NvmlProbe().process(json.loads((FIXTURES / "rtx4090-2.json").read_text())["output"])
    gpus = tuple(replace(g, processes=None if procs is None else tuple(procs.get(g.index, ()))) for g in facts.gpus)
    return replace(facts, gpus=gpus)


def target(host: str, index: int, gpus: tuple[int, ...]) -> Target:
    return Target(host, "g", "m", index, "127.0.0.1", 8000 + index, "0.33.0", gpus)


T0, T1 = target("h1", 0, (0,)), target("h1", 1, (1,))
P = GpuProcess


def test_units_release_and_gpu_memory_per_instance() -> None:
    gpus = rtx4090_2(
        {
            0: [P(1234, 20 * GiB, "vllm", "fleet-vllm-0.service"), P(1300, GiB, "python3", "fleet-vllm-0.service")],
            1: [P(999, 3 * GiB, "other", "someone-else.service")],
        }
    )
    answer = HostStatus(process_units(UNITS_PART), gpus, None)
    got = unit_facts([T0, T1], {"h1": answer})
    u0, u1 = got["h1/vllm-0"], got["h1/vllm-1"]
    assert u0.state == "active/running" and u0.active and u0.restarts == 0 and u0.main_pid == 901
    assert u0.release == RELEASE and u0.vllm_version == "0.33.0"
    assert u0.venv == f"/opt/fleet/vllm/releases/{RELEASE}"
    assert u0.gpu_memory_used == 21 * GiB  # engine core and worker, both in the unit's cgroup
    assert u1.state == "inactive/dead" and not u1.active and u1.uptime_seconds is None
    assert u1.gpu_memory_used == 0  # a foreign process on its GPU is not charged to it


def test_recorded_lab_answer() -> None:
    """A lab host after ``systemctl stop fleet-vllm-1.service``: the running instance is charged
    what its engine core holds on GPU 0, the stopped one nothing."""
    got = unit_facts([T0, T1], {"h1": HostStatusProbe().process(RECORDED)})
    assert got["h1/vllm-0"].gpu_memory_used == 23197227418 and got["h1/vllm-0"].state == "active/running"
    assert got["h1/vllm-1"].gpu_memory_used == 0 and got["h1/vllm-1"].state == "inactive/dead"


def test_each_row_shows_the_release_its_process_runs() -> None:
    """After a canary (or a halted rollout) one instance runs another release than ``current``
    names: the row says what it runs (issue 25: status showed the link, not the process)."""
    from .test_units_fact import A_RELEASE, ANOTHER

    targets = [target("h1", i, (i,)) for i in range(3)]
    got = unit_facts(targets, {"h1": HostStatusProbe().process(ANOTHER)})
    assert (got["h1/vllm-1"].release, got["h1/vllm-1"].vllm_version) == ("next", "0.33.1")
    assert got["h1/vllm-1"].venv == "/opt/fleet/vllm/releases/next"
    assert (got["h1/vllm-0"].release, got["h1/vllm-0"].vllm_version) == (A_RELEASE, "0.33.0")
    assert got["h1/vllm-0"].venv == f"/opt/fleet/vllm/releases/{A_RELEASE}"
    assert got["h1/vllm-2"].release == A_RELEASE and got["h1/vllm-2"].state == "inactive/dead"


def test_gpu_memory_edge_cases() -> None:
    # NVML refused the process list: unknown, not zero
    assert gpu_memory_of(T0, rtx4090_2(None)) is None
    assert gpu_memory_of(T0, None) is None
    # the probe could not read a process's cgroup: on the instance's GPU it counts
    assert gpu_memory_of(T0, rtx4090_2({0: [P(5, 2 * GiB, None, None)]})) == 2 * GiB
    # no GPU list in the plan: only processes known to be the unit's
    loose = target("h1", 0, ())
    facts = rtx4090_2({0: [P(5, 2 * GiB, None, None)], 1: [P(6, GiB, "x", "fleet-vllm-0.service")]})
    assert gpu_memory_of(loose, facts) == GiB


def test_unreachable_host_and_a_unit_that_is_not_installed() -> None:
    t2 = target("h2", 0, (0,))
    t3 = target("h1", 5, (0,))
    answers = {"h2": HostUnreachable("h2", "cannot reach 10.0.0.2:22: timed out"),
               "h1": HostStatus(process_units(UNITS_PART), None, "NVML: no-nvml-library: not found")}  # fmt: skip
    got = unit_facts([T0, t2, t3], answers)
    assert got["h2/vllm-0"].state == "unreachable" and "timed out" in got["h2/vllm-0"].detail
    assert got["h1/vllm-5"].state == "not installed" and got["h1/vllm-5"].gpu_memory_used is None
    assert got["h1/vllm-0"].gpu_memory_used is None and "no-nvml-library" in got["h1/vllm-0"].detail
    assert unit_facts([target("h9", 0, ())], answers) == {}  # no answer (--no-ssh): no facts


def row(t: Target) -> InstanceStatus:
    return InstanceStatus(target=t, health=Health.READY)


def test_attach_units_sets_problems_and_json() -> None:
    active = UnitFacts("active/running", 120.0, 0, "/opt/fleet/vllm/releases/r", 20 * GiB, "r", "0.33.0", 1234)
    stopped = UnitFacts("inactive/dead", None, 0, None, 0)
    gone = UnitFacts("unreachable", None, None, None, None, detail="cannot reach h1:22: refused")
    looping = replace(active, restarts=9)
    rows = attach_units(
        [row(T0), row(T1), row(target("h2", 0, ())), row(target("h3", 0, ()))],
        {"h1/vllm-0": active, "h1/vllm-1": stopped, "h2/vllm-0": gone, "h3/vllm-0": looping},
        {"h3": Thresholds(restarts=3)},
    )
    assert rows[0].ok and rows[0].problems == ()
    assert rows[1].problems == ("unit fleet-vllm-1.service is inactive/dead",) and not rows[1].ok
    assert rows[2].problems == ("host unreachable over SSH: cannot reach h1:22: refused",)
    assert rows[3].problems == ("unit restarted 9 times",)
    data = status_data(rows[0])["unit"]
    assert data == {
        "state": "active/running", "uptime_seconds": 120.0, "restarts": 0, "venv": "/opt/fleet/vllm/releases/r",
        "release": "r", "installed_vllm_version": "0.33.0", "main_pid": 1234,
        "gpu_memory_used_bytes": 20 * GiB, "detail": "",
    }  # fmt: skip
    # rows without facts keep theirs
    assert attach_units([row(T0)], {})[0].unit is None

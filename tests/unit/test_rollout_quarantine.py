"""Rollouts and restarts plan around the GPUs the watcher quarantined, as ``fleet deploy`` does:
``quarantine_and_unread`` (pure, table) and ``fleet_of`` given one round of facts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleet.facts.runner import HostUnreachable, SshTarget
from fleet.gpuwatch.state import GpuEvent, GpuWatch, WatchState, quarantine_and_unread
from fleet.inventory.spec import HostSpec
from fleet.plan.outcomes import load_for_planning
from fleet.rollout.fleet_inventory import Facts, fleet_of

WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}
XID79 = GpuEvent(3, 1.0, "xid", 79, "reboot", "GPU has fallen off the bus")
SBE = GpuEvent(1, 1.0, "sbe", None, "none", "single-bit ECC error corrected")


def gpu(index: int, *events: GpuEvent, quarantine: GpuEvent | None = None) -> GpuWatch:
    return GpuWatch(f"GPU-{index}", index, f"0000:0{index}:00.0", events, 0, quarantine)


def watch(*gpus: GpuWatch) -> WatchState:
    return WatchState("ok", None, "rec-1", 3, gpus)


@pytest.mark.parametrize(
    ("answer", "held", "unread"),
    [
        (watch(gpu(0), gpu(1, SBE)), None, None),  # nothing critical: nothing held, nothing said
        (watch(gpu(0), gpu(2, XID79, quarantine=XID79)), {2: "XID 79 (reboot): GPU has fallen off the bus"}, None),
        (WatchState("none", "no watcher record on the host"), None, "none: no watcher record on the host"),
        (WatchState("foreign", "written on machine 'x'"), None, "foreign: written on machine 'x'"),
        (WatchState("bad-record", "record.json is not JSON"), None, "bad-record: record.json is not JSON"),
        (HostUnreachable("h1", "SSH failed: connection refused", ssh_failed=True), None, "SSH failed: connection"),
        (None, None, "not read"),
    ],
)
def test_quarantine_and_unread(answer: Any, held: dict[int, str] | None, unread: str | None) -> None:
    answers = {} if answer is None else {"h1": answer}
    got_held, got_unread = quarantine_and_unread(answers, ["h1"])
    assert got_held == ({"h1": held} if held else {})
    if unread is None:
        assert got_unread == {}
    else:
        assert unread in got_unread["h1"] and "planned without a quarantine" in got_unread["h1"]


def _inventory(tmp_path: Path) -> Path:
    rows = [
        (name, {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": WORKLOAD, "ssh_hostname": f"127.0.250.{k}",
                "gpu": {"sku": "l40s-48gb", "count": 4}})
        for k, name in ((3, "h1"), (4, "h2"))
    ]  # fmt: skip
    path = tmp_path / "fleet.py"
    path.write_text(f"gpus = {rows!r}\n")
    return path


def _round(watch_of: Mapping[str, WatchState | HostUnreachable]) -> Any:
    asked: list[list[str]] = []

    def read(specs: Sequence[HostSpec], ssh: Mapping[str, SshTarget]) -> Facts:
        asked.append([s.name for s in specs])
        return {}, watch_of

    return read, asked


def test_a_rollout_plans_around_a_quarantined_gpu_and_names_a_host_whose_record_is_unread(tmp_path: Path) -> None:
    loaded = load_for_planning(_inventory(tmp_path))
    before = fleet_of(loaded, read=_round({})[0])
    assert [s.gpus for r, s in before.instances.items() if r.host == "h1"] == [(0,), (1,), (2,), (3,)]
    read, asked = _round({"h1": watch(gpu(2, XID79, quarantine=XID79)), "h2": HostUnreachable("h2", "timed out")})
    fleet = fleet_of(loaded, read=read)
    assert asked == [["h1", "h2"]]  # every host's record, in the one round
    assert [s.gpus for r, s in fleet.instances.items() if r.host == "h1"] == [(0,), (1,), (3,)]
    assert [s.gpus for r, s in fleet.instances.items() if r.host == "h2"] == [(0,), (1,), (2,), (3,)]  # as today
    assert fleet.quarantined == {"h1": {2: "XID 79 (reboot): GPU has fallen off the bus"}}
    assert list(fleet.unread_quarantine) == ["h2"] and "timed out" in fleet.unread_quarantine["h2"]


def test_a_host_with_every_gpu_quarantined_refuses_the_rollout_before_touching_a_host(tmp_path: Path) -> None:
    from fleet.errors import FleetError

    loaded = load_for_planning(_inventory(tmp_path))
    every = watch(*(gpu(i, XID79, quarantine=XID79) for i in range(4)))
    with pytest.raises(FleetError, match="every GPU is quarantined") as exc:
        fleet_of(loaded, read=_round({"h1": every})[0])
    assert "fleet gpu clear h1" in str(exc.value)

"""``fleet status`` shows the GPUs the watcher quarantined: ``quarantined_gpus`` (pure, table),
the problem line under the 80-column table, and the ``--json`` fields."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from fleet.cli.status_view import status_view
from fleet.gpuwatch.state import GpuEvent, GpuWatch, WatchState
from fleet.monitor.status import (
    Health,
    InstanceStatus,
    QuarantinedGpu,
    attach_host_state,
    quarantined_gpus,
    status_data,
)
from fleet.monitor.targets import Target

AT = 1795000000.0  # 2026-11-18 11:06:40Z
XID79 = GpuEvent(3, AT, "xid", 79, "reboot", "GPU has fallen off the bus")
DBE = GpuEvent(4, AT + 60, "dbe", None, "reset", "double-bit ECC error")
SBE = GpuEvent(1, AT, "sbe", None, "info", "single-bit ECC error corrected")


def gpu(index: int, event: GpuEvent | None = None, *, cleared: bool = False) -> GpuWatch:
    events = (event,) if event is not None else ()
    held = event if event is not None and event.critical and not cleared else None
    return GpuWatch(f"GPU-{index}", index, f"0000:0{index}:00.0", events, 0, held)


RECORD = WatchState("ok", None, "rec-1", 4, (gpu(0), gpu(1, SBE), gpu(2, XID79), gpu(3, DBE, cleared=True)))
Q2 = QuarantinedGpu(2, "GPU-2", "xid", 79, "reboot", AT, "GPU has fallen off the bus")


@pytest.mark.parametrize(
    ("gpus", "watch", "expected"),
    [
        ((0, 1), RECORD, ()),  # an SBE is not critical
        ((2,), RECORD, (Q2,)),
        ((2, 3), RECORD, (Q2,)),  # GPU 3's DBE was cleared
        ((0, 1, 2, 3), RECORD, (Q2,)),
        ((2,), WatchState("foreign", "another machine's"), ()),  # a record fleet cannot trust says nothing here
        ((2,), None, ()),  # no record read
        ((), RECORD, ()),  # no GPUs known for the instance
    ],
)
def test_quarantined_gpus(
    gpus: tuple[int, ...], watch: WatchState | None, expected: tuple[QuarantinedGpu, ...]
) -> None:
    assert quarantined_gpus(gpus, watch) == expected


def rows() -> list[InstanceStatus]:
    t = [Target("gpu-3", "serving", "meta-llama/Llama-3.1-8B-Instruct", i, "127.0.0.1", 8000 + i, "0.33.0", (i,))
         for i in range(4)]  # fmt: skip
    return attach_host_state([InstanceStatus(x, Health.READY, version="0.33.0") for x in t], {}, {}, None,
                             {"gpu-3": RECORD})  # fmt: skip


def test_an_instance_on_a_quarantined_gpu_has_a_problem_and_json_fields() -> None:
    out = rows()
    assert [r.ok for r in out] == [True, True, False, True]
    problem = "GPU 2 quarantined since 2026-11-18 11:06:40Z: XID 79 (reboot); after repair: fleet gpu clear " \
        "INVENTORY gpu-3 2 --why TEXT"  # fmt: skip
    assert out[2].problems == (problem,)
    data = status_data(out[2])
    assert data["quarantine"] == [{"gpu": 2, "uuid": "GPU-2", "kind": "xid", "xid": 79, "action": "reboot",
                                   "since": AT, "meaning": "GPU has fallen off the bus"}]  # fmt: skip
    assert data["ok"] is False and problem in data["problems"]
    assert status_data(out[0])["quarantine"] == []


def test_the_80_column_view_says_it_under_the_table() -> None:
    console = Console(width=80, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    console.print(status_view(rows(), 2.0))
    console.file.close()
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    below = text[text.index("gpu-3/vllm-2:") :]
    flat = " ".join(below.split())
    assert "GPU 2 quarantined since 2026-11-18 11:06:40Z: XID 79 (reboot)" in flat
    assert "fleet gpu clear INVENTORY gpu-3 2 --why TEXT" in flat
    assert "gpu-3/vllm-0:" not in text and "gpu-3/vllm-3:" not in text

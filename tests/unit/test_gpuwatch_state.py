"""fleet's reading of a host's watcher record (``fleet.gpuwatch.state``): records written by the
watcher's own ``Record`` class, read back through the fact's own command run by ``sh`` here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fleet.gpuwatch.state import parse_watch_state, watch_command
from fleet.gpuwatch.watcher import CLEARS, Record, read_machine_id

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


def record(state: Path, events: list[tuple[int, str, int | None]], machine_id: str | None = None) -> Record:
    r = Record(str(state), machine_id if machine_id is not None else read_machine_id(), "h", 1000.0)
    for i, uuid in enumerate(UUIDS):
        r.gpu(uuid, i, f"00000000:{0x18 + i:02X}:00.0", "NVIDIA H100 80GB HBM3", "nvml")
    for n, (gpu, kind, xid) in enumerate(events):
        r.add(UUIDS[gpu], kind, xid, 1001.0 + n, "nvml")
    r.save(1100.0)
    return r


def clear(state: Path, r: Record, gpu: int, through: int) -> None:
    entry = {"record_id": r.data["record_id"], "through_seq": through, "by": "ops", "why": "reseated", "at": 1200.0}
    (state / CLEARS).write_text(json.dumps({"gpus": {UUIDS[gpu]: [entry]}}))


def read(state: Path):  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("the fact's command reads as root (sudo -n is not offered here)")
    out = subprocess.run(["sh", "-c", watch_command(str(state))], capture_output=True, text=True, check=True)
    return parse_watch_state(out.stdout.splitlines())


def test_no_record_is_none(tmp_path: Path) -> None:
    assert read(tmp_path).status == "none"


@pytest.mark.parametrize(
    ("events", "quarantined"),
    [
        ([], {}),
        ([(2, "xid", 79)], {2: 79}),  # fell off the bus: reset/reboot
        ([(0, "xid", 13), (1, "sbe", None)], {}),  # an application's error; a corrected ECC error
        ([(3, "dbe", None)], {3: None}),
        (
            [(2, "xid", 79), (2, "xid", 48), (1, "xid", 95), (0, "xid", 94)],
            {2: 79, 1: 95},
        ),  # the first critical one; 94 contained
    ],
)
def test_quarantine(tmp_path: Path, events: list[tuple[int, str, int | None]], quarantined: dict[int, int]) -> None:
    record(tmp_path, events)
    state = read(tmp_path)
    assert state.ok, state.error
    assert {i: e.xid for i, e in state.quarantined().items()} == quarantined


def test_a_clear_lifts_it_until_the_next_critical_event(tmp_path: Path) -> None:
    r = record(tmp_path, [(2, "xid", 79)])
    clear(tmp_path, r, 2, r.data["seq"])
    assert read(tmp_path).quarantined() == {}
    r.add(UUIDS[2], "xid", 79, 1300.0, "nvml")
    r.save(1300.0)
    (event,) = read(tmp_path).quarantined().values()
    assert event.seq == r.data["seq"]


def test_events_since_a_restart(tmp_path: Path) -> None:
    r = record(tmp_path, [(2, "xid", 79)])
    baseline = r.data["seq"]
    r.add(UUIDS[2], "xid", 31, 1400.0, "nvml")
    r.add(UUIDS[3], "xid", 79, 1401.0, "nvml")
    r.save(1401.0)
    state = read(tmp_path)
    assert [(i, e.xid) for i, e in state.events_since(r.data["record_id"], baseline, {2})] == [(2, 31)]
    # another record (the old one moved aside): every event of the new one is new
    assert [(i, e.xid) for i, e in state.events_since("0" * 16, baseline, {2, 3})] == [(2, 79), (2, 31), (3, 79)]


def test_a_record_from_another_machine_is_refused(tmp_path: Path) -> None:
    record(tmp_path, [(2, "xid", 79)], machine_id="f" * 32)
    state = read(tmp_path)
    assert state.status == "foreign" and "f" * 32 in (state.error or "") and "cloned" in (state.error or "")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not JSON"),
        ('{"schema": 9}', "schema 9"),
        (
            '{"schema": 1, "record_id": "x", "machine_id": "", "seq": 1, "gpus": {"u": {"events": [{"seq": 5}]}}}',
            "without a valid seq",
        ),
        (
            '{"schema": 1, "record_id": "x", "machine_id": "MID", "seq": 1, "gpus": {"u": {"events": [{"seq": 1}]}}}',
            "event kind",
        ),
    ],
)
def test_a_corrupt_record_is_said(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "record.json").write_text(text.replace("MID", read_machine_id()))
    state = read(tmp_path)
    assert state.status == "bad-record" and why in (state.error or "")


def test_no_root() -> None:
    assert parse_watch_state(['--fleet-gpu-watch--{"status": "no-root"}']).status == "no-root"
    assert parse_watch_state(["sh: 1: oops"]).status == "bad-output"

"""The watcher's pure parts: the record check, the textfile, journal entries (table tests)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.gpuwatch.watcher import (
    cleared_through,
    journal_message,
    journal_time,
    new_record,
    record_problem,
    textfile,
)


def record_with(events: list[dict[str, Any]], counts: dict[str, int]) -> dict[str, Any]:
    record = new_record("m" * 32, "gpu-01", 100.0)
    record["seq"] = max([e["seq"] for e in events], default=0)
    record["gpus"] = {
        "GPU-a": {"index": 0, "bus_id": "00000000:18:00.0", "source": "nvml", "events": [], "counts": {}},
        "GPU-b": {"index": 1, "bus_id": "00000000:2A:00.0", "source": "kernel-log", "events": events,
                  "counts": counts, "last_event_at": 150.5},
    }  # fmt: skip
    return record


def test_the_textfile_parses_as_prometheus_text_and_says_what_is_quarantined() -> None:
    events = [{"seq": 1, "t": 150.5, "kind": "xid", "xid": 79, "action": "reboot"},
              {"seq": 2, "t": 151.0, "kind": "sbe", "xid": None, "action": "info"}]  # fmt: skip
    record = record_with(events, {"xid:79": 1, "sbe": 1})
    text = textfile(record, {}, True, 200.0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    b = {"gpu": "1", "uuid": "GPU-b"}
    assert value("fleet_gpu_quarantined", **b, kind="xid", xid="79", action="reboot") == 1
    assert value("fleet_gpu_quarantined", gpu="0", uuid="GPU-a") == 0
    assert value("fleet_gpu_events_total", **b, kind="xid", xid="79", action="reboot") == 1
    assert value("fleet_gpu_events_total", **b, kind="sbe", xid="", action="info") == 1
    assert value("fleet_gpu_last_event_timestamp_seconds", **b) == 150.5
    assert value("fleet_gpu_watch_source", **b, source="kernel-log") == 1
    assert value("fleet_gpu_watch_up") == 1
    assert value("fleet_gpu_watch_last_update_timestamp_seconds") == 200.0

    cleared = {"gpus": {"GPU-b": [{"record_id": record["record_id"], "through_seq": 1}]}}
    assert 'fleet_gpu_quarantined{gpu="1",uuid="GPU-b"} 0' in textfile(record, cleared, False, 201.0)


@pytest.mark.parametrize(
    ("clears", "expected"),
    [
        ({}, 0),
        ({"gpus": {"GPU-b": [{"record_id": "R", "through_seq": 4}, {"record_id": "R", "through_seq": 2}]}}, 4),
        ({"gpus": {"GPU-b": [{"record_id": "other", "through_seq": 9}]}}, 0),  # a clear of an older record
        ({"gpus": {"GPU-b": [{"record_id": "R", "through_seq": "9"}]}}, 0),
        ({"gpus": {"GPU-b": "garbage"}}, 0),
        ([], 0),
    ],
)
def test_cleared_through(clears: Any, expected: int) -> None:
    assert cleared_through(clears, "R", "GPU-b") == expected


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([], "not a JSON object"),
        ({"schema": 2}, "schema 2, not 1"),
        ({**new_record("m", "h", 1.0), "seq": "3"}, "seq='3' is not a int"),
        ({**new_record("m", "h", 1.0), "gpus": {"GPU-a": {"events": [{"seq": 5}]}}}, "without a valid seq"),
        ({**new_record("m", "h", 1.0), "gpus": {"GPU-a": {}}}, "has no event list"),
        (new_record("m", "h", 1.0), None),
    ],
)
def test_record_problem(raw: Any, problem: str | None) -> None:
    got = record_problem(raw)
    assert got == problem if problem is None else problem in str(got)


def test_journal_entries() -> None:
    assert journal_message({"MESSAGE": "NVRM: Xid"}) == "NVRM: Xid"
    assert journal_message({"MESSAGE": [78, 86, 0xC3, 0x28]}) == "NV\ufffd("  # not UTF-8: journald's byte array
    assert journal_time({"__REALTIME_TIMESTAMP": "1700000000123456"}, 5.0) == 1700000000.123456
    assert journal_time({}, 5.0) == 5.0

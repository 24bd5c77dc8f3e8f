"""The XID catalogue, the quarantine rule and the kernel-log parser (pure, table tests)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from fleet.gpuwatch import catalog
from fleet.gpuwatch.catalog import (
    APP,
    BUCKET_ACTION,
    CRITICAL,
    INFO,
    REBOOT,
    RESET,
    SERVICE,
    UNKNOWN,
    XIDS,
    KernelXid,
    meaning,
    parse_kernel_xid,
    quarantine_since,
    trim,
    xid_action,
)


@pytest.mark.parametrize(
    ("xid", "action"),
    [
        (79, REBOOT),  # fallen off the bus: RESTART_BM
        (48, RESET),  # double-bit ECC: WORKFLOW_XID_48
        (95, RESET),  # uncontained memory error
        (64, RESET),  # row remapping failure
        (74, RESET),  # NVLink error workflow
        (119, RESET),  # GSP RPC timeout
        (154, RESET),  # recovery action changed
        (54, SERVICE),  # aux power not connected: CHECK_MECHANICALS
        (78, SERVICE),  # vGPU start: UPDATE_SWFW
        (151, REBOOT),  # RESTART_VM
        (13, APP),  # graphics engine exception: the application's
        (31, APP),  # page fault
        (94, APP),  # contained memory error: the application got it, the GPU is fine
        (45, APP),  # cleanup after an earlier error
        (63, INFO),  # a row remapped
        (92, INFO),  # high single-bit rate
        (43, INFO),
        (999, UNKNOWN),  # NVML's "unknown xid"
        (7, UNKNOWN),  # unused in the catalog
    ],
)
def test_xid_actions(xid: int, action: str) -> None:
    assert xid_action(xid) == action


def test_every_bucket_in_the_catalogue_has_an_action() -> None:
    assert {x.bucket for x in XIDS.values()} <= set(BUCKET_ACTION)
    assert all(number == x.number for number, x in XIDS.items())


@pytest.mark.parametrize(
    ("kind", "xid", "action", "text"),
    [
        ("xid", 79, REBOOT, "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (GPU has fallen off the bus)"),
        ("xid", 31, APP, "GPU memory page fault"),
        ("xid", 999, UNKNOWN, "XID 999: not in fleet's catalogue"),
        ("dbe", None, RESET, "double-bit"),
        ("sbe", None, INFO, "corrected"),
    ],
)
def test_meaning(kind: str, xid: int | None, action: str, text: str) -> None:
    got_action, got_text = meaning(kind, xid)
    assert got_action == action and text in got_text


@pytest.mark.parametrize(("kind", "xid"), [("xid", None), ("ecc", None), ("", 3)])
def test_meaning_refuses_what_is_not_an_event(kind: str, xid: int | None) -> None:
    with pytest.raises(ValueError, match="an event is"):
        meaning(kind, xid)


def ev(seq: int, action: str) -> dict[str, Any]:
    return {"seq": seq, "action": action}


@pytest.mark.parametrize(
    ("events", "cleared", "since"),
    [
        ([], 0, None),
        ([ev(1, APP), ev(2, INFO), ev(3, UNKNOWN)], 0, None),  # nothing critical
        ([ev(1, APP), ev(2, REBOOT), ev(3, RESET)], 0, 2),  # the first critical one
        ([ev(2, REBOOT)], 2, None),  # cleared through it
        ([ev(2, REBOOT), ev(5, RESET)], 2, 5),  # a new one after the clear
        ([ev(5, SERVICE), ev(2, REBOOT)], 0, 2),  # order of the list does not matter
        ([ev(7, APP)], 6, None),  # only an app error after the clear
    ],
)
def test_quarantine_since(events: list[dict[str, Any]], cleared: int, since: int | None) -> None:
    got = quarantine_since(events, cleared)
    assert (got["seq"] if got else None) == since


def test_critical_actions() -> None:
    assert set(CRITICAL) == {RESET, REBOOT, SERVICE}


@pytest.mark.parametrize(
    ("actions", "keep", "kept_seqs", "dropped"),
    [
        ([INFO, INFO, INFO], 5, [1, 2, 3], 0),
        ([INFO, INFO, INFO], 2, [2, 3], 1),
        ([REBOOT, INFO, INFO, INFO], 2, [1, 4], 2),  # the critical one outlives a flood
        ([REBOOT, RESET, SERVICE], 2, [2, 3], 1),  # all critical: the oldest goes
    ],
)
def test_trim(actions: list[str], keep: int, kept_seqs: list[int], dropped: int) -> None:
    events = [ev(i + 1, a) for i, a in enumerate(actions)]
    kept, n = trim(list(reversed(events)), keep)
    assert [e["seq"] for e in kept] == kept_seqs and n == dropped


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        (
            "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
            KernelXid("00000000:1B:00.0", 79, "pid=1234, name=python3, GPU has fallen off the bus."),
        ),
        (  # journal's kernel transport keeps the prefix of the printk level in some setups
            "[12345.678] NVRM: Xid (PCI:0001:c3:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
            "double bit error",
            KernelXid("00000001:C3:00.0", 48, "pid='<unknown>', name=<unknown>, An uncorrectable double bit error"),
        ),
        (  # older drivers: no "PCI:"
            "NVRM: Xid (0000:03:00): 14, Channel 00000001",
            KernelXid("00000000:03:00.0", 14, "Channel 00000001"),
        ),
        ("NVRM: GPU at PCI:0000:1b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae", None),
        ("NVRM: Xid (PCI:0000:1b:00): seventy-nine", None),
        ("usb 1-1: new high-speed USB device", None),
    ],
)
def test_parse_kernel_xid(line: str, parsed: KernelXid | None) -> None:
    assert parse_kernel_xid(line) == parsed


def test_the_catalogue_runs_on_python_3_6() -> None:
    """It is carried to hosts: no syntax newer than 3.6, standard library only."""
    source = Path(catalog.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 6))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"re", "typing"}

"""The simulated NVML's event API, driven by the unmodified pynvml in a subprocess.

pynvml 13.615's ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``,
``nvmlDeviceGetSupportedEventTypes``, ``nvmlEventSetWait_v2`` (its ``c_nvmlEventData_t``) and
``nvmlEventSetFree`` against faults injected with :mod:`fleetlab.nvml.faults`. Return codes
follow NVML's API reference ("Event Handling Methods"). No lab host and no root needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from fleetlab.nvml import build_shim
from fleetlab.nvml.faults import fault_line, inject
from fleetlab.profiles import load_profile

HELPERS = textwrap.dedent(
    """
    import json, sys, time
    import pynvml as N

    def err(fn, *args):
        try:
            fn(*args)
            return None
        except N.NVMLError as exc:
            return type(exc).__name__

    def wait(s, ms):
        try:
            d = N.nvmlEventSetWait_v2(s, ms)
        except N.NVMLError as exc:
            return type(exc).__name__
        return {"gpu": N.nvmlDeviceGetIndex(d.device), "type": d.eventType, "data": d.eventData,
                "gi": d.gpuInstanceId, "ci": d.computeInstanceId}

    N.nvmlInit()
    hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
    XID, SBE, DBE = N.nvmlEventTypeXidCriticalError, N.nvmlEventTypeSingleBitEccError, N.nvmlEventTypeDoubleBitEccError
    """
)


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim")).parent


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def profile_file(tmp_path: Path, name: str, extra_host: str = "") -> Path:
    profile = load_profile(name)
    if extra_host:
        text = profile.path.read_text()
        text = text.replace("[driver]", f"[host]\n{extra_host}\n\n[driver]", 1)
        custom = tmp_path / f"{name}-custom.toml"
        custom.write_text(text)
        profile = load_profile(str(custom))
    path = tmp_path / f"{name}.profile"
    path.write_text(profile.render())
    return path


def start(shim_dir: Path, profile: Path, state_dir: Path, body: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(shim_dir),
        "FLEET_NVML_PROFILE": str(profile),
        "FLEET_NVML_STATE_DIR": str(state_dir),
    }
    script = HELPERS + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(shim_dir: Path, profile: Path, state_dir: Path, body: str) -> Any:
    proc = start(shim_dir, profile, state_dir, body)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def test_supported_event_types_follow_the_board(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    body = "print(json.dumps([N.nvmlDeviceGetSupportedEventTypes(h) for h in hs]))"
    assert run(shim_dir, profile_file(tmp_path, "h100-sxm-8"), state_dir, body) == [0xFF9F] * 8
    # no ECC on a GeForce board: "ECC events are available only on ECC enabled devices"
    assert run(shim_dir, profile_file(tmp_path, "rtx4090-2"), state_dir, body) == [0xFF9C] * 2
    off = profile_file(tmp_path, "a10-1", "nvml_events = false")
    assert run(shim_dir, off, state_dir, body) == [0]


def test_an_xid_is_delivered_once_with_its_gpu_and_number(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    """A waiter blocked in nvmlEventSetWait_v2 wakes when the lab injects XID 79 on GPU 2."""
    body = """
        s = N.nvmlEventSetCreate()
        for h in hs:
            N.nvmlDeviceRegisterEvents(h, XID | SBE | DBE, s)
        print("registered", flush=True)
        t0 = time.time()
        first = wait(s, 10000)
        waited = time.time() - t0
        again = wait(s, 200)
        N.nvmlEventSetFree(s)
        print(json.dumps({"first": first, "again": again, "waited": waited}))
    """
    inject(state_dir, 1, "xid", 13, at=time.time() - 60)  # before the registration: never delivered
    proc = start(shim_dir, profile_file(tmp_path, "h100-sxm-8"), state_dir, body)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "registered"
        time.sleep(0.3)
        inject(state_dir, 2, "xid", 79)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result["first"] == {"gpu": 2, "type": 8, "data": 79, "gi": 0xFFFFFFFF, "ci": 0xFFFFFFFF}
    assert result["again"] == "NVMLError_Timeout"
    assert 0.3 <= result["waited"] < 10  # it blocked, and woke for the fault rather than the timeout


def test_events_in_order_per_set_and_type(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    events = state_dir / "events"
    body = f"""
        s1, s2 = N.nvmlEventSetCreate(), N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(hs[2], XID, s1)
        N.nvmlDeviceRegisterEvents(hs[2], XID | DBE, s2)
        N.nvmlDeviceRegisterEvents(hs[5], DBE, s2)
        with open({str(events)!r}, "a") as f:
            t = time.time()
            f.write("%f 2 xid 79\\n" % (t + 0.3))      # due later
            f.write("%f 2 xid 48\\n" % t)              # due now: first, though written second
            f.write("%f 5 dbe\\n" % t)                 # only s2 registered DBE on GPU 5
            f.write("%f 3 xid 31\\n" % t)              # GPU 3: nobody registered
            f.write("garbage line\\n")
            f.write("%f 2 sbe\\n" % t)                 # SBE: nobody registered
        early = wait(s1, 100)
        s1_all = [early, wait(s1, 2000), wait(s1, 100)]
        s2_all = [wait(s2, 2000), wait(s2, 2000), wait(s2, 2000), wait(s2, 100)]
        print(json.dumps({{"s1": s1_all, "s2": s2_all}}))
    """
    out = run(shim_dir, profile_file(tmp_path, "h100-sxm-8"), state_dir, body)
    no_mig = {"gi": 0xFFFFFFFF, "ci": 0xFFFFFFFF}
    xid48 = {"gpu": 2, "type": 8, "data": 48, **no_mig}
    xid79 = {"gpu": 2, "type": 8, "data": 79, **no_mig}
    dbe5 = {"gpu": 5, "type": 2, "data": 0, **no_mig}
    assert out["s1"] == [xid48, xid79, "NVMLError_Timeout"]
    assert out["s2"][:2] == [xid48, dbe5] or out["s2"][:2] == [dbe5, xid48]
    assert out["s2"][2:] == [xid79, "NVMLError_Timeout"]


def test_a_fault_before_registration_is_not_recorded(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    inject(state_dir, 0, "xid", 79, at=time.time() - 1)
    body = """
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(hs[0], XID, s)
        print(json.dumps(wait(s, 300)))
    """
    assert run(shim_dir, profile_file(tmp_path, "a10-1"), state_dir, body) == "NVMLError_Timeout"


def test_a_due_ecc_fault_counts_in_the_ecc_counters(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    inject(state_dir, 1, "dbe")
    inject(state_dir, 1, "dbe")
    inject(state_dir, 1, "sbe")
    inject(state_dir, 1, "dbe", at=time.time() + 3600)  # not yet
    body = """
        def counts(h):
            return [N.nvmlDeviceGetTotalEccErrors(h, e, c) for e in (0, 1) for c in (0, 1)]
        print(json.dumps([counts(hs[0]), counts(hs[1])]))
    """
    assert run(shim_dir, profile_file(tmp_path, "h100-sxm-8"), state_dir, body) == [[0, 0, 0, 0], [1, 1, 2, 2]]


def test_return_codes(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    body = """
        s = N.nvmlEventSetCreate()
        out = {
            "unknown_bits": err(N.nvmlDeviceRegisterEvents, hs[0], 1 << 40, s),
            "ecc_on_geforce": err(N.nvmlDeviceRegisterEvents, hs[0], XID | DBE, s),
            "xid_on_geforce": err(N.nvmlDeviceRegisterEvents, hs[0], XID, s),
            "wait_zero": wait(s, 0),
            "free": err(N.nvmlEventSetFree, s),
        }
        N.nvmlShutdown()
        out["create_uninitialized"] = err(N.nvmlEventSetCreate)
        print(json.dumps(out))
    """
    out = run(shim_dir, profile_file(tmp_path, "rtx4090-2"), state_dir, body)
    assert out == {
        "unknown_bits": "NVMLError_InvalidArgument",
        "ecc_on_geforce": "NVMLError_NotSupported",  # "none of the requested types are registered"
        "xid_on_geforce": None,  # "event set can still be used"
        "wait_zero": "NVMLError_Timeout",
        "free": None,
        "create_uninitialized": "NVMLError_Uninitialized",
    }


def test_no_event_support_answers_not_supported(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    body = """
        s = N.nvmlEventSetCreate()
        print(json.dumps(err(N.nvmlDeviceRegisterEvents, hs[0], XID, s)))
    """
    off = profile_file(tmp_path, "a10-1", "nvml_events = false")
    assert run(shim_dir, off, state_dir, body) == "NVMLError_NotSupported"


def test_a_reloaded_driver_ends_the_wait_with_unknown(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    profile = profile_file(tmp_path, "a10-1")
    body = f"""
        import os
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(hs[0], XID, s)
        before = wait(s, 50)
        text = open({str(profile)!r}).read()
        os.unlink({str(profile)!r})
        gone = wait(s, 50)
        with open({str(profile)!r} + ".new", "w") as f:
            f.write(text)
        os.rename({str(profile)!r} + ".new", {str(profile)!r})
        replaced = wait(s, 50)
        N.nvmlShutdown()
        N.nvmlInit()
        s2 = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(0), XID, s2)
        print(json.dumps([before, gone, replaced, wait(s2, 50)]))
    """
    out = run(shim_dir, profile, state_dir, body)
    assert out == ["NVMLError_Timeout", "NVMLError_Unknown", "NVMLError_Unknown", "NVMLError_Timeout"]


def test_fault_lines_are_validated() -> None:
    assert fault_line(2, "xid", 79, at=100.0) == "100.000000 2 xid 79\n"
    assert fault_line(0, "dbe", at=1.5) == "1.500000 0 dbe\n"
    for bad in ((32, "xid", 79), (0, "xid", None), (0, "ecc", None), (0, "sbe", 3), (True, "dbe", None)):
        with pytest.raises(ValueError):
            fault_line(*bad)  # type: ignore[arg-type]

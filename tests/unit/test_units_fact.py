"""The units fact's pure ``process()`` on recorded output, its uptime arithmetic, and the combined
status probe's split (units, then the NVML probe)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fleet.facts.hoststatus import SEPARATOR, HostStatusProbe, split_output
from fleet.facts.units import VllmUnits, process_units, unit_uptime, units_command

FIXTURES = Path(__file__).parents[1] / "fixtures" / "status"
#: ``HostStatusProbe().command()`` run on a lab host (Debian 12, systemd 252, 2x RTX 4090) that
#: ``fleet deploy`` took to serving, after ``systemctl stop fleet-vllm-1.service``: the units part,
#: the separator, then the NVML probe's JSON line.
RECORDED = (FIXTURES / "lab-rtx4090-2-one-stopped.txt").read_text().splitlines()
UNITS_PART = RECORDED[: RECORDED.index(SEPARATOR)]
RELEASE = "vllm-0.33.0-py3.11.2-3cd450f82eb9"


def test_recorded_output() -> None:
    got = VllmUnits().process(UNITS_PART)
    assert got["current"] == f"releases/{RELEASE}" and got["release"] == RELEASE
    assert got["vllm_version"] == "0.33.0"
    u0, u1 = got["units"]["fleet-vllm-0.service"], got["units"]["fleet-vllm-1.service"]
    assert u0 == {
        "load_state": "loaded",
        "active_state": "active",
        "sub_state": "running",
        "restarts": 0,
        "main_pid": 901,
        "uptime_seconds": pytest.approx(5.12, abs=0.01),  # now 1795384974.12 - ExecMainStart @1795384969
        # recorded before the command read each unit's interpreter: what current names
        "exe": None,
        "release": RELEASE,
        "vllm_version": "0.33.0",
    }
    assert u1["active_state"] == "inactive" and u1["sub_state"] == "dead"
    assert u1["uptime_seconds"] is None and u1["main_pid"] is None
    assert set(got["units"]) == {"fleet-vllm-0.service", "fleet-vllm-1.service"}


#: ``HostStatusProbe().command()`` run on a lab host (8x H100 SXM, systemd 252) that ``fleet deploy``
#: took to serving, after: a copy of its release relocated to ``releases/next`` (its marker edited
#: to say vLLM 0.33.1, to tell the two apart), ``fleet-vllm-1`` restarted with ``current`` on
#: ``next``, ``current`` put back, and ``fleet-vllm-2`` stopped. As after a canary or a halted
#: rollout: ``current`` names one release, one instance runs another.
ANOTHER = (FIXTURES / "lab-h100-8-one-on-another-release.txt").read_text().splitlines()
A_RELEASE = "vllm-0.33.0-py3.11.2-19b227f6cd9e"


def test_each_unit_runs_the_release_of_its_own_process_not_the_current_link() -> None:
    got = HostStatusProbe().process(ANOTHER).units
    assert got["release"] == A_RELEASE  # the host's current link
    units = got["units"]
    assert len(units) == 8
    one, two = units["fleet-vllm-1.service"], units["fleet-vllm-2.service"]
    assert one["exe"] == "/opt/fleet/vllm/releases/next/bin/python3"
    assert one["release"] == "next" and one["vllm_version"] == "0.33.1"
    assert two["active_state"] == "inactive" and two["exe"] is None
    assert two["release"] == A_RELEASE  # stopped: it starts next on what current names
    others = {name: (u["release"], u["vllm_version"]) for name, u in units.items() if name not in (
        "fleet-vllm-1.service", "fleet-vllm-2.service")}  # fmt: skip
    assert set(others.values()) == {(A_RELEASE, "0.33.0")}, others


def test_an_interpreter_outside_the_releases_falls_back_to_current() -> None:
    lines = [f"current releases/{RELEASE}", "root /srv/vllm", "unit Id=fleet-vllm-0.service", "unit ActiveState=active",
             "unit MainPID=7", "exe fleet-vllm-0.service /usr/bin/python3", "unit end"]  # fmt: skip
    info = process_units(lines)["units"]["fleet-vllm-0.service"]
    assert info["exe"] == "/usr/bin/python3" and info["release"] == RELEASE
    lines[-2] = "exe fleet-vllm-0.service /srv/vllm/releases/r9/bin/python"  # under this host's root
    assert process_units(lines)["units"]["fleet-vllm-0.service"]["release"] == "r9"


def test_recorded_combined_output() -> None:
    got = HostStatusProbe().process(RECORDED)
    assert got.gpu_error is None and got.gpus is not None
    procs = [(g.index, [(p.pid, p.unit) for p in g.processes or ()]) for g in got.gpus.gpus]
    assert procs == [(0, [(909, "fleet-vllm-0.service")]), (1, [])]  # the engine core of the running one


def test_nothing_deployed() -> None:
    got = process_units(["now 1795384540.1 3960.26", "current "])
    assert got == {"units": {}, "current": None, "release": None, "vllm_version": None}


def test_version_from_vllm_when_the_release_has_no_marker() -> None:
    got = process_units([f"current /opt/fleet/vllm/releases/{RELEASE}/", "version 0.33.0"])
    assert got["release"] == RELEASE and got["vllm_version"] == "0.33.0"


def test_a_bad_marker_and_foreign_units_are_ignored() -> None:
    lines = ["marker {not json", "unit Id=other.service", "unit ActiveState=active", "unit end", "garbage"]
    got = process_units(lines)
    assert got["vllm_version"] is None and got["units"] == {}


def test_restart_count_and_a_missing_unit_file() -> None:
    lines = ["unit Id=fleet-vllm-2.service", "unit LoadState=not-found", "unit ActiveState=inactive",
             "unit NRestarts=7", "unit end"]  # fmt: skip
    info = process_units(lines)["units"]["fleet-vllm-2.service"]
    assert info["load_state"] == "not-found" and info["restarts"] == 7


OLD_SYSTEMD = {
    "ActiveState": "active",
    "ExecMainStartTimestamp": "Sun 2026-11-22 21:00:00 UTC",
    "ExecMainStartTimestampMonotonic": "3000000000",
}
NEVER_STARTED = {"ActiveState": "active", "ExecMainStartTimestamp": "", "ExecMainStartTimestampMonotonic": "0"}


@pytest.mark.parametrize(
    ("props", "now_unix", "now_mono", "expected"),
    [
        ({"ActiveState": "active", "ExecMainStartTimestamp": "@100"}, 160.5, None, 60.5),
        # ExecMainStart missing (older systemd, no --timestamp=unix): the monotonic twin
        (OLD_SYSTEMD, 5000.0, 3100.0, 100.0),
        ({"ActiveState": "active", "ActiveEnterTimestamp": "@100"}, 130.0, None, 30.0),
        ({"ActiveState": "activating", "ExecMainStartTimestamp": "@100"}, 130.0, None, None),
        ({"ActiveState": "inactive", "ExecMainStartTimestamp": "@100"}, 130.0, None, None),
        (NEVER_STARTED, 130.0, 50.0, None),
        ({"ActiveState": "active", "ExecMainStartTimestamp": "@200"}, 130.0, None, 0.0),  # clock skew: never negative
    ],
)
def test_uptime(props: dict[str, str], now_unix: float | None, now_mono: float | None, expected: float | None) -> None:
    assert unit_uptime(props, now_unix, now_mono) == expected


def test_the_commands_are_valid_shell_and_quote_the_root() -> None:
    cmd = units_command("/opt/my fleet/vllm")
    assert "'/opt/my fleet/vllm'/current" in cmd
    for text in (cmd, HostStatusProbe().command()):
        assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0


def test_the_combined_command_runs_units_then_the_probe() -> None:
    cmd = HostStatusProbe().command()
    assert cmd.index("systemctl show") < cmd.index(SEPARATOR) < cmd.index("FLEET_NVML_PROBE_EOF")
    assert split_output(["a", SEPARATOR, "b"]) == (["a"], ["b"])
    assert split_output(["a"]) == (["a"], [])


def test_a_failed_probe_keeps_the_units() -> None:
    got = HostStatusProbe().process([*UNITS_PART, SEPARATOR, "not json"])
    assert got.gpus is None and got.gpu_error and "not JSON" in got.gpu_error
    assert got.units["units"]["fleet-vllm-0.service"]["active_state"] == "active"
    got = HostStatusProbe().process(UNITS_PART)
    assert got.gpus is None and got.gpu_error == "the NVML probe printed nothing"

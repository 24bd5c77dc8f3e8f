"""``fleet drain`` / ``fleet undrain``: the host's marker (its fact, read by a real shell), the
``--reason`` rule, what the on-call is told, the status row of a drained instance and of one its
balancer holds out of traffic, and bad input refused before any host is touched."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.facts.batch import FactRequest, answer_of
from fleet.facts.drain import (
    MARKER_PATH,
    NOT_DRAINED,
    Drained,
    DrainMarker,
    MarkerOrBatch,
    UnlessDrained,
    marker_command,
    parse_marker,
)
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.gpuwatch.state import GpuWatchState, WatchState
from fleet.inventory.schema import DRAIN_REASON_RULE, drain_reason
from fleet.lb.runtime import AdminState, ServerView
from fleet.monitor.status import Health, InstanceStatus, State, UnitFacts, attach_host_state, state_of, status_data
from fleet.monitor.targets import Target
from fleet.operations.files import write_command
from fleet.rollout.advice import next_steps
from fleet.rollout.batches import InstanceRef
from fleet.rollout.drain import POLICY
from fleet.rollout.engine import Phase, RolloutStatus, new_rollout
from fleet.rollout.engine import Target as RolloutTarget
from fleet.rollout.policy import parse_policy

REPO = Path(__file__).resolve().parents[2]
MARKER = DrainMarker("ops@ctl", 1_790_000_000.0, "swap the NVMe", "20260101T000000Z-abc123", ("vllm-0", "vllm-1"))


# ---- the marker -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "expect"),
    [
        ([], None),
        (["FLEET-DRAINED", MARKER.to_json()], MARKER),
        (["FLEET-DRAINED", *MARKER.to_json().splitlines()], MARKER),
        (["FLEET-DRAINED"], DrainMarker("?", 0.0, "", unreadable="root could not read it (sudo -n)")),
        (["something else"], None),
    ],
)
def test_parse_marker(lines: list[str], expect: DrainMarker | None) -> None:
    assert parse_marker(lines) == expect


@pytest.mark.parametrize(
    "text",
    ['["a list"]', '{"by": "x", "reason": "y"}', '{"by": 1, "at": 2, "reason": "y"}', '{"by": "x", "at": true, '
     '"reason": "y"}', "not json"],
)  # fmt: skip
def test_a_marker_fleet_did_not_write_still_means_drained(text: str) -> None:
    marker = parse_marker(["FLEET-DRAINED", text])
    assert marker is not None and marker.unreadable.startswith("not fleet's marker")
    assert "exists but could not be read" in marker.describe()


def test_the_fact_reads_the_file_fleet_writes(tmp_path: Path) -> None:
    """The marker written by the one atomic-write helper (as ``fleet drain`` sends it), then read by
    the fact's own command in a real shell (without the ``sudo -n`` in front: no sudo here)."""
    path = tmp_path / "state" / "drained.json"
    command = write_command(str(path), MARKER.to_json().encode(), 0o600, str(os.getuid()), str(os.getgid()))
    stdin = str(command.connector_arguments.get("_stdin"))
    subprocess.run(command.get_raw_value(), shell=True, input=stdin, text=True, check=True)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    argv = shlex.split(marker_command(str(path)))
    assert argv[:2] == ["sudo", "-n"]
    out = subprocess.run(argv[2:], capture_output=True, text=True, check=True).stdout
    assert Drained().process(out.splitlines()) == MARKER
    assert Drained().command() == marker_command(MARKER_PATH)
    path.unlink()
    out = subprocess.run(argv[2:], capture_output=True, text=True, check=True).stdout
    assert out == "" and Drained().process([]) is None


def _write_marker(path: Path) -> None:
    command = write_command(str(path), MARKER.to_json().encode(), 0o600, str(os.getuid()), str(os.getgid()))
    stdin = str(command.connector_arguments.get("_stdin"))
    subprocess.run(command.get_raw_value(), shell=True, input=stdin, text=True, check=True)


def _shim(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def local_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """pyinfra's ``@local`` host, with ``sudo`` on the PATH: this machine has none (and the tests
    run as the user the marker belongs to), so ``sudo -n CMD`` runs CMD."""
    from pyinfra.api.config import Config
    from pyinfra.api.connect import connect_all
    from pyinfra.api.inventory import Inventory
    from pyinfra.api.state import State as PyinfraState

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if not any(Path(d, "sudo").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        _shim(bin_dir / "sudo", '[ "$1" = -n ] && shift\nexec "$@"')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    inventory = Inventory((["@local"], {}))
    state = PyinfraState(inventory, Config())  # type: ignore[no-untyped-call]
    connect_all(state)
    yield state, inventory.get_host("@local"), bin_dir
    for h in inventory:
        h.disconnect()  # type: ignore[no-untyped-call]


def test_the_first_round_never_probes_a_drained_host_and_reads_the_rest_as_on_their_own(
    local_host: Any, tmp_path: Path
) -> None:
    """The deploy's first round (``fleet.deploy.runner._first_round``: ``UnlessDrained`` over the
    NVML probe and the GPU watcher record) through pyinfra's ``get_fact`` in a real shell: with a
    marker, the marker and nothing else (the probe's Python never starts); without one, the
    probe and the record, each the value the fact read on its own gives."""
    from pyinfra.api.facts import get_fact

    state, host, bin_dir = local_host
    probed = tmp_path / "probed"
    python = _shim(bin_dir / "probe-python", f'echo run >> {shlex.quote(str(probed))}\nexec {sys.executable} "$@"')
    requests = [
        FactRequest(NvmlProbe, {"python": python, "code_cache": None}),
        FactRequest(GpuWatchState, {"state_dir": str(tmp_path / "watch")}),
    ]
    commands = [r.shell() for r in requests]
    path = tmp_path / "state" / "drained.json"
    _write_marker(path)

    answer = get_fact(state, host, UnlessDrained, kwargs={"commands": commands, "path": str(path)})
    assert answer == MarkerOrBatch(MARKER)
    assert not probed.exists()  # drained: the probe did not run

    path.unlink()
    answer = get_fact(state, host, UnlessDrained, kwargs={"commands": commands, "path": str(path)})
    assert isinstance(answer, MarkerOrBatch) and answer.marker is None and sorted(answer.answers) == [0, 1]
    assert probed.read_text() == "run\n"
    probe = answer_of(requests[0], answer.answers[0])
    assert isinstance(probe, HostFacts) and probe.pynvml is not None and probe.pynvml.startswith("fleet:")
    alone = get_fact(state, host, NvmlProbe, kwargs=dict(requests[0].kwargs))
    assert isinstance(alone, HostFacts) and (probe.status, probe.gpus, probe.pynvml) == (
        alone.status, alone.gpus, alone.pynvml,
    )  # fmt: skip
    watch = answer_of(requests[1], answer.answers[1])
    assert isinstance(watch, WatchState) and watch.status == "none"
    assert watch == get_fact(state, host, GpuWatchState, kwargs=dict(requests[1].kwargs))
    assert state.failed_hosts == set()


def test_a_marker_that_cannot_be_read_fails_the_first_round_as_the_marker_fact_and_runs_nothing(
    tmp_path: Path,
) -> None:
    """When the marker's command fails (here: no ``sudo`` at all), so does ``UnlessDrained``, with
    its status and nothing after it: the deploy then takes the host for not drained, as it took
    a failed ``Drained`` read, and reads its probe on its own."""
    ran = tmp_path / "ran"
    command = UnlessDrained().command([f": > {shlex.quote(str(ran))}"], str(tmp_path / "drained.json"))
    done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, env={"PATH": str(tmp_path)},
                          check=False)  # fmt: skip
    alone = subprocess.run(["/bin/sh", "-c", marker_command(str(tmp_path / "drained.json"))], capture_output=True,
                           text=True, env={"PATH": str(tmp_path)}, check=False)  # fmt: skip
    assert done.returncode == alone.returncode != 0
    assert done.stdout == alone.stdout == ""
    assert not ran.exists()


@pytest.mark.parametrize(
    ("lines", "expect"),
    [
        ([], None),
        (["FLEET-DRAINED", MARKER.to_json()], MarkerOrBatch(MARKER)),
        ([NOT_DRAINED], MarkerOrBatch(None, {})),
        (["something else"], None),
    ],
)
def test_unless_drained_process(lines: list[str], expect: MarkerOrBatch | None) -> None:
    assert UnlessDrained().process(lines) == expect


def test_the_deploys_first_round_reads_the_probe_and_the_watcher_record() -> None:
    from fleet.deploy.runner import FIRST_ROUND, _drained

    assert [r.fact for r in FIRST_ROUND] == [NvmlProbe, GpuWatchState]
    assert _drained({"a": MarkerOrBatch(MARKER), "b": MarkerOrBatch(None, {}), "c": None}) == {"a": MARKER}


def test_marker_for_people_and_json() -> None:
    assert MARKER.describe() == "drained by ops@ctl at 2026-09-21 14:13:20 UTC: swap the NVMe"
    assert MARKER.data() == {"by": "ops@ctl", "at": 1_790_000_000.0, "at_utc": "2026-09-21 14:13:20 UTC",
                             "reason": "swap the NVMe", "rollout": "20260101T000000Z-abc123",
                             "unreadable": None}  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "ok"),
    [
        ("swap the NVMe", True),
        ("  GPU 3 Xid 79, RMA #4411  ", True),
        ("Wartung: Netzteil tauschen", True),
        ("", False),
        ("   ", False),
        ("two\nlines", False),
        ("tab\there", False),
        ("x" * 501, False),
        ("token sk-proj-" + "a1B2c3D4e5" * 4, False),
    ],
)
def test_drain_reason(reason: str, ok: bool) -> None:
    if ok:
        assert drain_reason(reason) == reason.strip()
    else:
        with pytest.raises(ValueError, match="printable"):
            drain_reason(reason)


# ---- the policy and what the on-call is told -------------------------------------------------------


def test_the_drain_policy_takes_every_instance_at_once_and_halts() -> None:
    policy = parse_policy({"batches": [1, "25%"], "max_unavailable": 1}, source="inv.py", where="all",
                          overrides=POLICY)  # fmt: skip
    assert policy.batches == (-1,) and policy.max_unavailable == "100%" and policy.whole_host
    assert policy.on_failure.value == "halt" and policy.canary_bake_s == 0


def _state(kind: str, status: RolloutStatus, phases: dict[str, Phase]) -> Any:
    from dataclasses import replace

    targets = [RolloutTarget(InstanceRef.parse(r), "v1", "m", stop_only=kind == "drain") for r in phases]
    policy = parse_policy({}, source="x", where="y", overrides=POLICY)
    state = new_rollout("r1", "/inv.py", kind, targets, policy, 0.0)
    instances = {ref: replace(i, phase=phases[str(ref)]) for ref, i in state.instances.items()}
    return replace(state, status=status, instances=instances, reason="batch 1 failed (x)")


def test_next_steps_after_a_drain_and_an_undrain() -> None:
    done = next_steps(_state("drain", RolloutStatus.DONE, {"gpu-1/vllm-0": Phase.DONE}))
    assert done[0].startswith("drained: every instance of gpu-1 is out of traffic and stopped")
    assert "fleet undrain /inv.py gpu-1" in done[0]
    halted = next_steps(_state("drain", RolloutStatus.HALTED, {"gpu-1/vllm-0": Phase.FAILED}))
    assert halted[0] == "halted: batch 1 failed (x)"
    assert "stay marked drained" in halted[2] and "fleet undrain /inv.py gpu-1" in halted[2]
    back = next_steps(_state("undrain", RolloutStatus.DONE, {"gpu-1/vllm-0": Phase.DONE}))
    assert back[0] == "gpu-1: every instance serves and is back in traffic; the drain markers are removed"
    stuck = next_steps(_state("undrain", RolloutStatus.HALTED, {"gpu-1/vllm-0": Phase.FAILED}))
    assert any("stays marked drained" in line for line in stuck)


# ---- fleet status: drained rows and the balancer's view --------------------------------------------

TARGET = Target("h1", "g", "m", 0, "127.0.0.1", 8000, "0.33.0")
UP = ServerView("m", "h1:vllm-0", AdminState.READY, "UP", 3, 0, "L7OK")
MAINT = ServerView("m", "h1:vllm-0", AdminState.MAINT, "MAINT", 0, 0)
STOPPED = UnitFacts("inactive/dead", None, 0, None, None)


def _row(health: Health, unit: UnitFacts | None = None) -> InstanceStatus:
    return InstanceStatus(TARGET, health, "connection refused" if health is not Health.READY else "", unit=unit)


@pytest.mark.parametrize(
    ("row", "drained", "lb", "ok", "problems"),
    [
        # a drained instance: stopped and in maintenance on purpose: no problem
        (_row(Health.NOT_LISTENING, STOPPED), True, MAINT, True, []),
        # the same without the marker: its unit is down
        (_row(Health.NOT_LISTENING, STOPPED), False, MAINT, False, ["unit fleet-vllm-0.service is inactive/dead"]),
        # serving and in traffic
        (_row(Health.READY), False, UP, True, []),
        # serving but left out of traffic (a halted rollout): say so, with the command
        (_row(Health.READY), False, MAINT, False,
         ["serving but out of its balancer's traffic (MAINT, maint): fleet lb ready INVENTORY h1/vllm-0"]),
        # the balancer could not be asked
        (_row(Health.READY), False, "haproxy on this machine (/x.sock): connection refused", False,
         ["load balancer: haproxy on this machine (/x.sock): connection refused"]),
    ],
)  # fmt: skip
def test_status_rows_with_drain_and_balancer(
    row: InstanceStatus, drained: bool, lb: ServerView | str, ok: bool, problems: list[str]
) -> None:
    [out] = attach_host_state([row], {"h1": MARKER} if drained else {}, {"h1/vllm-0": lb})
    assert out.ok is ok
    assert list(out.problems) == problems
    assert out.state == (State.DRAINED if drained else state_of(row.health, row.unit))


def test_status_json_of_a_drained_row() -> None:
    [out] = attach_host_state([_row(Health.NOT_LISTENING, STOPPED)], {"h1": MARKER}, {"h1/vllm-0": MAINT})
    data = status_data(out)
    assert data["state"] == "drained" and data["ok"] is True
    assert data["drained"]["by"] == "ops@ctl" and data["drained"]["reason"] == "swap the NVMe"
    assert data["balancer"] == {"view": "MAINT", "admin": "maint", "status": "MAINT", "sessions": 0, "queued": 0,
                                "backend": "m", "server": "h1:vllm-0", "error": None}  # fmt: skip
    [plain] = attach_host_state([_row(Health.READY)], {}, {})
    assert status_data(plain)["drained"] is None and status_data(plain)["balancer"] is None
    json.dumps(data)


# ---- bad input: refused before any host is touched --------------------------------------------------


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)  # fmt: skip


def _inventory(tmp_path: Path) -> Path:
    # hosts on a port nothing listens on: any SSH attempt would fail the test with "cannot reach"
    data = {"model": "meta-llama/Llama-3.1-8B-Instruct", "ssh_hostname": "127.0.0.1", "ssh_port": 1,
            "gpu": {"sku": "h100-sxm-80gb", "count": 1},
            "workload": {"p95_input_tokens": 1024, "p95_output_tokens": 256, "prefix_reuse": 0.0,
                         "target_concurrency": 8}}  # fmt: skip
    path = tmp_path / "inventory.py"
    path.write_text(
        f"gpus = ([('gpu-1', {{**{data!r}, 'port': 8000}}), ('gpu-2', {{**{data!r}, 'port': 8100}})], {{}})\n"
    )
    return path


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["gpu-1", "--reason", "two\nlines"], f"--reason 'two\\nlines': {DRAIN_REASON_RULE}"),
        (["gpu-1", "--reason", "sk-proj-" + "a1B2c3D4e5" * 4], "--reason <redacted>"),
        (["gpus", "--reason", "x"], "gpus: give the names of vLLM hosts"),
        (["gpu-*", "--reason", "x"], "gpu-*: give the names of vLLM hosts"),
        (["gpu-9", "--reason", "x"], "gpu-9"),
    ],
)
def test_bad_drain_input_exits_2_touching_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    out = fleet("drain", str(_inventory(tmp_path)), *args, "--json", "--journal", str(tmp_path / "j.sqlite"))
    assert out.returncode == 2, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert says in body["error"], body
    assert "a1B2c3D4e5" not in out.stdout + out.stderr
    assert "cannot reach" not in out.stdout + out.stderr
    assert not (tmp_path / "j.sqlite").exists()


def test_drain_needs_a_reason(tmp_path: Path) -> None:
    out = fleet("drain", str(_inventory(tmp_path)), "gpu-1")
    assert out.returncode == 2
    assert "--reason" in out.stderr


# ---- which hosts a rollout skips: the markers, and the journal for a host that is down --------------


def test_drained_view_takes_the_marker_and_for_a_host_that_is_down_the_journal() -> None:
    from fleet.facts.drain import drained_view
    from fleet.facts.runner import HostUnreachable

    other = DrainMarker("ops@b", 1.0, "PSU", "r2")
    answers = {
        "up-drained": MARKER,
        "up-serving": None,
        "down-drained-here": HostUnreachable("down-drained-here", "cannot reach 10.0.0.3:22: timed out"),
        "down-unknown": HostUnreachable("down-unknown", "cannot reach 10.0.0.4:22: timed out"),
    }
    view = drained_view(answers, {"down-drained-here": other, "up-serving": other})
    assert set(view) == {"up-drained", "down-drained-here"}  # the host's own word wins over the journal's
    assert view["up-drained"] == MARKER
    assert view["down-drained-here"].by == "ops@b"
    assert view["down-drained-here"].reason == (
        "PSU (the host does not answer: cannot reach 10.0.0.3:22: timed out; the journal says it is drained)"
    )


def test_the_journal_knows_which_hosts_its_drains_marked(tmp_path: Path) -> None:
    from fleet.rollout.journal import Journal

    policy = parse_policy({}, source="x", where="y", overrides=POLICY)

    def rollout(rid: str, kind: str, fleet_name: str = "/inv.py") -> Any:
        state = new_rollout(rid, fleet_name, kind, [RolloutTarget(InstanceRef.parse("a/vllm-0"), "v1", "m")], policy, 0)
        journal.begin(state)
        return state

    with Journal(tmp_path / "j.sqlite") as journal:
        one = rollout("r1", "drain")
        for host in ("a", "b", "c"):
            marker = DrainMarker("ops@ctl", 10.0, f"fix {host}", "r1")
            journal.record(one, "marker:drained", f"host {host}", True, marker.to_json().strip(), 10.0, host)
        journal.record(one, "marker:drained", "host d", False, "SSH failed", 10.0, "d")  # not written
        two = rollout("r2", "undrain")
        journal.record(two, "marker:removed", "host b", True, "every instance serves", 20.0, "b")
        journal.record(two, "marker:removed", "host c", False, "SSH failed", 20.0, "c")  # still there
        other = rollout("r3", "drain", "/other.py")
        journal.record(other, "marker:drained", "host e", True, MARKER.to_json().strip(), 30.0, "e")
        drained = journal.drained_hosts("/inv.py")
    assert sorted(drained) == ["a", "c"]
    assert drained["a"].reason == "fix a" and drained["a"].rollout == "r1"

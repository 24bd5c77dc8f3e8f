"""``fleet restart`` / ``fleet rollout`` / ``fleet rollback`` on lab hosts that ``fleet deploy`` got serving.

Two lab hosts with two RTX 4090s each: ``fleet deploy`` installs release A and starts two vLLM
stand-in instances per host (four in all). Other releases are made on the hosts the way a venv is
relocated (a copy with its paths rewritten): ``next`` (a good one) and ``bad`` (its engine fails
to load the model: the stand-in's ``fail_load`` fault, switched on for that release only through
``FLEET_LAB_FAULTS``). Every test asserts the end state of every instance: unit active, the
release its process runs, the model it serves over HTTP, and which processes were restarted.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko
import pytest

from fleet.lab import lab as lab_ops
from fleet.lab import ssh
from fleet.rollout.fleet_inventory import RolloutFleet, load_fleet
from fleet.rollout.journal import Journal
from fleet.rollout.probe import InstanceProber

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
ROOT = "/opt/fleet/vllm"
FAST = ["--batches", "1,-1", "--soak", "1", "--probe-interval", "0.5", "--health-timeout", "60", "--json"]


def on_host(lab: LabFleet, index: int, command: str, timeout: float = 120) -> tuple[int, str, str]:
    h = lab.state.hosts[index]
    client: paramiko.SSHClient = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def must(lab: LabFleet, index: int, command: str) -> str:
    rc, out, err = on_host(lab, index, command)
    assert rc == 0, f"host {index}: {command}: {err or out}"
    return out


def bring_up_serving(root: Path, name: str, octet: int, hosts: int = 2) -> tuple[LabFleet, RolloutFleet]:
    """``hosts`` lab hosts serving release A after ``fleet deploy`` (model load: 2 s, the stand-in's
    knob), with releases ``next`` and ``bad`` installed beside it. The caller takes the lab down."""
    opts = test_lab_options(root, name, octet, hosts, ("rtx4090-2",))
    lab = LabFleet(opts, bring_up(opts))
    config = base64.b64encode(CONFIG.read_bytes()).decode()
    for i in range(hosts):
        must(
            lab, i,
            "sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group "
            f"vllm && sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee "
            f"{HUB}/refs/main >/dev/null && echo {config} | base64 -d | sudo -u vllm tee "
            f"{HUB}/snapshots/main/config.json >/dev/null && sudo mkdir -p /etc/fleet-lab && "
            "echo '{\"load_seconds\": 2}' | sudo tee /etc/fleet-lab/vllm-faults.json >/dev/null",
        )  # fmt: skip
    proc = subprocess.run(
        [str(FLEET), "deploy", str(opts.inventory), "--json", "--health-timeout", "120"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fleet = load_fleet(str(opts.inventory))
    assert len(fleet.instances) == 2 * hosts, fleet.instances
    for i in range(hosts):
        make_release(lab, i, "next")
        make_release(lab, i, "bad", fail_load=True)
    return lab, fleet


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabFleet, RolloutFleet]]:
    require_lab()
    root = tmp_path_factory.mktemp("rollout-lab")
    octet = free_octet(os.getpid() + 29, avoid=frozenset({TEST_OCTET}))
    name = f"pr{os.getpid()}"
    try:
        yield bring_up_serving(root, name, octet)
    finally:
        lab_ops.down(name, root / "state")


def make_release(lab: LabFleet, index: int, name: str, fail_load: bool = False) -> None:
    """A copy of the current release relocated to ``releases/<name>`` (shebangs rewritten)."""
    script = (
        f"set -e; r={ROOT}; a=$(readlink $r/current); a=${{a#releases/}}; n={name}; "
        "sudo cp -a $r/releases/$a $r/releases/$n; cd $r/releases/$n; "
        'for f in $(sudo grep -rIl "releases/$a" bin pyvenv.cfg); do [ -L "$f" ] || '
        'sudo sed -i "s#releases/$a#releases/$n#g" "$f"; done'
    )
    if fail_load:
        script += (
            "; sudo mv bin/vllm bin/vllm-real; printf '#!/bin/sh\\nexport FLEET_LAB_FAULTS=/etc/fleet-lab/bad.json\\n"
            'exec "$(dirname "$0")/vllm-real" "$@"\\n\' | sudo tee bin/vllm >/dev/null; sudo chmod 755 bin/vllm; '
            f'echo \'{{"fail_load": ["{MODEL}"], "load_seconds": 1}}\' '
            "| sudo tee /etc/fleet-lab/bad.json >/dev/null"
        )
    must(lab, index, script)


def instance_state(lab: LabFleet, fleet: RolloutFleet) -> dict[str, dict[str, Any]]:
    """Every instance: unit state, MainPID, NRestarts, the release its process runs, what it serves."""
    out: dict[str, dict[str, Any]] = {}
    for i, host in enumerate(fleet.hosts):
        current = must(lab, i, f"readlink {ROOT}/current").strip().removeprefix("releases/")
        for ref, spec in fleet.instances.items():
            if ref.host != host:
                continue
            show = must(lab, i, f"systemctl show -p ActiveState,SubState,MainPID,NRestarts {spec.unit}")
            values = dict(line.split("=", 1) for line in show.split())
            pid = int(values["MainPID"])
            exe = must(lab, i, f"tr '\\000' '\\n' < /proc/{pid}/cmdline | head -n 1").strip() if pid else ""
            models = InstanceProber(spec.url, 5).models()
            out[str(ref)] = {
                "unit": f"{values['ActiveState']}/{values['SubState']}",
                "pid": pid,
                "restarts": int(values["NRestarts"]),
                "runs": exe.removeprefix(f"{ROOT}/releases/").split("/")[0],
                "current": current,
                "serves": models.ids if models.status == 200 else (),
            }
    return out


def fleet_cli(*args: str, journal: Path, timeout: float = 600) -> tuple[int, Any]:
    proc = subprocess.run(
        [str(FLEET), *args, "--journal", str(journal)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def assert_all_serving(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], release: str) -> None:
    for name, inst in after.items():
        assert inst["unit"] == "active/running", (name, inst)
        assert inst["runs"] == release, (name, inst)
        assert inst["serves"] == (MODEL,), (name, inst)
        assert inst["restarts"] == before[name]["restarts"], (name, inst)  # systemd never restarted it itself


def test_restart_with_limit_restarts_only_that_host(serving: tuple[LabFleet, RolloutFleet], tmp_path: Path) -> None:
    lab, fleet = serving
    before = instance_state(lab, fleet)
    h0 = fleet.hosts[0]
    rc, result = fleet_cli("restart", fleet.inventory, "--limit", h0, *FAST, journal=tmp_path / "j.sqlite")
    assert rc == 0, result
    assert result["status"] == "done" and result["kind"] == "restart"
    assert sorted(i["instance"] for i in result["instances"]) == sorted(f"{h0}/vllm-{n}" for n in (0, 1))
    after = instance_state(lab, fleet)
    release = before[f"{h0}/vllm-0"]["runs"]
    assert_all_serving(before, after, release)
    for name in after:
        restarted = after[name]["pid"] != before[name]["pid"]
        assert restarted == name.startswith(f"{h0}/"), (name, before[name], after[name])
    with Journal(tmp_path / "j.sqlite") as j:
        actions = [(s.instance, s.action) for s in j.steps(result["id"])]
    assert actions == [(f"{h0}/vllm-0", "stop"), (f"{h0}/vllm-0", "start"),
                       (f"{h0}/vllm-1", "stop"), (f"{h0}/vllm-1", "start")]  # fmt: skip


def test_rollout_refused_while_another_holds_the_lock(serving: tuple[LabFleet, RolloutFleet], tmp_path: Path) -> None:
    lab, fleet = serving
    before = instance_state(lab, fleet)
    with Journal(tmp_path / "j.sqlite") as j:
        j.acquire(fleet.name, "20260101T000000Z-other")  # this (live) test process holds it
        rc, result = fleet_cli("rollout", fleet.inventory, "--release", "next", *FAST, journal=tmp_path / "j.sqlite")
        assert rc == 2, result
        assert "is locked by rollout 20260101T000000Z-other" in result["error"]
        assert f"(pid {os.getpid()})" in result["error"] and "s ago)" in result["error"]
        assert j.history() == []  # nothing journaled
        j.release(fleet.name, "20260101T000000Z-other")
    after = instance_state(lab, fleet)
    assert {n: i["pid"] for n, i in after.items()} == {n: i["pid"] for n, i in before.items()}


def test_canary_that_fails_to_load_is_rolled_back_and_the_rollout_halts(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    lab, fleet = serving
    before = instance_state(lab, fleet)
    release = before[next(iter(before))]["runs"]
    rc, result = fleet_cli("rollout", fleet.inventory, "--release", "bad", *FAST, journal=tmp_path / "j.sqlite")
    assert rc == 1, result
    assert result["status"] == "halted"
    canary = f"{fleet.hosts[0]}/vllm-0"
    assert result["reason"].startswith(f"batch 1 failed ({canary}: unit gate: unit"), result["reason"]
    phases = {i["instance"]: i["phase"] for i in result["instances"]}
    assert phases == {canary: "rolled_back", **{n: "pending" for n in before if n != canary}}
    after = instance_state(lab, fleet)
    for name in after:
        assert after[name]["unit"] == "active/running" and after[name]["runs"] == release, (name, after[name])
        assert after[name]["serves"] == (MODEL,), (name, after[name])
        assert after[name]["current"] == release  # the link went back
        if name != canary:
            assert after[name]["pid"] == before[name]["pid"], name  # never touched
    with Journal(tmp_path / "j.sqlite") as j:
        steps = [(s.instance, s.action, s.detail.split(":")[0]) for s in j.steps(result["id"])]
    assert {s[0] for s in steps} == {canary}
    assert [a for _i, a, _d in steps] == ["stop", "flip", "start", "stop", "flip", "start"], steps


def _wait_for_step(journal: Path, action: str, count: int, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if journal.exists():
            with Journal(journal) as j:
                for r in j.history():
                    done = [s for s in j.steps(r.id) if s.action == action and s.outcome == "ok"]
                    if len(done) >= count:
                        return r.id
        time.sleep(0.2)
    raise AssertionError(f"no {count} {action} step(s) within {timeout}s")


def test_sigkill_of_the_control_process_then_resume_finishes(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    lab, fleet = serving
    before = instance_state(lab, fleet)
    journal = tmp_path / "j.sqlite"
    argv = [str(FLEET), "rollout", fleet.inventory, "--release", "next", *FAST, "--journal", str(journal)]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the second batch has begun: the second instance was stopped (mid-batch)
        rid = _wait_for_step(journal, "stop", 2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with Journal(journal) as j:
        assert j.latest_state(rid).status.value == "running"
        owner = j.lock_owner(fleet.name)
        assert owner is not None and owner.pid == proc.pid  # the dead process still holds it
    rc, refused = fleet_cli("rollout", "--resume", rid, "--json", journal=journal)
    assert rc == 2 and "stale lock" in refused["error"] and "--take-over" in refused["error"], refused
    rc, result = fleet_cli("rollout", "--resume", rid, "--take-over", "--json", journal=journal)
    assert rc == 0, result
    assert result["status"] == "done" and result["id"] == rid
    assert_all_serving(before, instance_state(lab, fleet), "next")
    assert all(i["current"] == "next" for i in instance_state(lab, fleet).values())


def test_rollback_to_the_previous_release_is_a_link_flip(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    lab, fleet = serving
    journal = tmp_path / "j.sqlite"
    first = must(lab, 0, f"ls {ROOT}/releases").split()
    original = next(r for r in first if r not in ("next", "bad"))
    rc, result = fleet_cli("rollout", fleet.inventory, "--release", "next", *FAST, journal=journal)
    assert rc == 0 and result["status"] == "done", result
    listing = {i: must(lab, i, f"stat -c '%n %i %Y' {ROOT}/releases/*") for i in range(2)}
    before = instance_state(lab, fleet)
    assert all(i["runs"] == "next" for i in before.values())
    rc, back = fleet_cli("rollback", fleet.inventory, *FAST, journal=journal)
    assert rc == 0, back
    assert back["kind"] == "rollback" and back["status"] == "done"
    after = instance_state(lab, fleet)
    assert_all_serving(before, after, original)
    assert all(i["current"] == original for i in after.values())
    assert all(must(lab, i, f"readlink {ROOT}/previous").strip() == "releases/next" for i in range(2))
    # no reinstall: the same release directories, same inodes, untouched
    assert {i: must(lab, i, f"stat -c '%n %i %Y' {ROOT}/releases/*") for i in range(2)} == listing


def test_orphaned_engine_after_sigkill_of_the_api_server_is_found_through_nvml_and_stopped(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """The API server is SIGKILLed; its ``VLLM::EngineCore`` child keeps the GPU (vllm#55510). With
    ``KillMode=process`` (a unit systemd only stops the main process of) the engine stays in the
    unit's cgroup holding the GPU; the restart finds it through NVML, names it and stops it."""
    lab, fleet = serving
    h0 = fleet.hosts[0]
    unit = fleet.instances[next(r for r in fleet.instances if r.host == h0)].unit
    dropin = f"/etc/systemd/system/{unit}.d/zz-test-killmode.conf"
    must(lab, 0, f"sudo mkdir -p /etc/systemd/system/{unit}.d && printf '[Service]\\nKillMode=process\\n' "
                 f"| sudo tee {dropin} >/dev/null && sudo systemctl daemon-reload")  # fmt: skip
    try:
        main = int(must(lab, 0, f"systemctl show -p MainPID --value {unit}"))
        engines = must(lab, 0, f"ps -o pid=,comm= --ppid {main}").split()
        engine_pid, comm = int(engines[0]), engines[1]
        assert comm == "VLLM::EngineCor"  # the kernel cuts comm at 15 characters
        must(lab, 0, f"sudo kill -KILL {main}")
        assert on_host(lab, 0, f"sudo kill -0 {engine_pid}")[0] == 0  # the orphan lives on
        rc, result = fleet_cli("restart", fleet.inventory, "--limit", h0, *FAST, journal=tmp_path / "j.sqlite")
        assert rc == 0, result
        with Journal(tmp_path / "j.sqlite") as j:
            kills = [s for s in j.steps(result["id"]) if s.action == "kill"]
        assert [(k.instance, k.outcome) for k in kills] == [(f"{h0}/vllm-0", "ok")]
        assert f"pid {engine_pid} (VLLM::EngineCor) holding" in kills[0].detail and "on GPU 0" in kills[0].detail
        assert on_host(lab, 0, f"sudo kill -0 {engine_pid}")[0] != 0  # gone
        after = instance_state(lab, fleet)
        for name, inst in after.items():
            assert inst["unit"] == "active/running" and inst["serves"] == (MODEL,), (name, inst)
    finally:
        must(lab, 0, f"sudo rm -f {dropin} && sudo systemctl daemon-reload")

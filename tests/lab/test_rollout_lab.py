"""``fleet restart`` / ``fleet rollout`` / ``fleet rollback`` on lab hosts that ``fleet deploy`` got serving.

Two lab hosts with two RTX 4090s each: ``fleet deploy`` installs release A and starts two vLLM
stand-in instances per host (four in all). Other releases are made on the hosts the way a venv is
relocated (a copy with its paths rewritten): ``next`` (a good one) and ``bad`` (its engine fails
to load the model: the stand-in's ``fail_load`` fault, switched on for that release only through
``FLEET_LAB_FAULTS``); the fault tests below make ``hung`` (``hang_after_load``) and ``flappy``
(a stall window) the same way. Every test asserts the end state of every instance: unit active,
the release its process runs, the model it serves over HTTP, and which processes were restarted.

The tests share one lab and run in file order; the last one cuts a host's power and brings it
back. Settings the command line has no option for (gate timeouts, hooks) go into a copy of the
lab's inventory with a ``rollout`` entry on every host (``inventory_with``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import paramiko
import pytest

from fleet.errors import FleetError
from fleet.rollout.fleet_inventory import RolloutFleet, load_fleet
from fleet.rollout.journal import Journal
from fleet.rollout.probe import InstanceProber
from fleetlab import lab as lab_ops
from fleetlab import ssh
from fleetlab.base import LOGIN_USER

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT
from .polling import wait_for

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
ROOT = "/opt/fleet/vllm"
FAST = ["--batches", "1,-1", "--soak", "1", "--probe-interval", "0.5", "--health-timeout", "60", "--json"]
#: Releases the tests make beside the one ``fleet deploy`` installed.
MADE = ("next", "bad", "hung", "flappy", "split")


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
        make_release(lab, i, "bad", faults={"fail_load": [MODEL], "load_seconds": 1})
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


def make_release(lab: LabFleet, index: int, name: str, faults: dict[str, Any] | None = None) -> None:
    """A copy of the current release relocated to ``releases/<name>`` (shebangs rewritten); with
    ``faults``, its ``vllm`` runs with those stand-in faults (``/etc/fleet-lab/<name>.json``)."""
    script = (
        f"set -e; r={ROOT}; a=$(readlink $r/current); a=${{a#releases/}}; n={name}; "
        "sudo cp -a $r/releases/$a $r/releases/$n; cd $r/releases/$n; "
        'for f in $(sudo grep -rIl "releases/$a" bin pyvenv.cfg); do [ -L "$f" ] || '
        'sudo sed -i "s#releases/$a#releases/$n#g" "$f"; done'
    )
    if faults is not None:
        encoded = base64.b64encode(json.dumps(faults).encode()).decode()
        script += (
            "; sudo mv bin/vllm bin/vllm-real; printf '#!/bin/sh\\n"
            f"export FLEET_LAB_FAULTS=/etc/fleet-lab/{name}.json\\n"
            'exec "$(dirname "$0")/vllm-real" "$@"\\n\' | sudo tee bin/vllm >/dev/null; sudo chmod 755 bin/vllm; '
            f"echo {encoded} | base64 -d | sudo tee /etc/fleet-lab/{name}.json >/dev/null"
        )
    must(lab, index, script)


def instance_state(lab: LabFleet, fleet: RolloutFleet, first_index: int = 0) -> dict[str, dict[str, Any]]:
    """Every instance: unit state, MainPID, NRestarts, the release its process runs, what it serves.
    ``first_index``: the lab index of ``fleet``'s first host (a fleet of one host: that host's)."""
    out: dict[str, dict[str, Any]] = {}
    for i, host in enumerate(fleet.hosts, start=first_index):
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


# ---- the GPU watcher as a gate (issue 24): an XID during the canary's soak, a critical finding -------
#
# ``fleet deploy`` installed the GPU watcher on both hosts (``fleet-gpu-watch.service``). A fault
# goes into the simulated NVML the way the lab injects one (``fleetlab.nvml.faults``: a line of the
# library's events file, delivered through nvmlEventSetWait_v2 at the line's time); a critical
# audit finding is the simulated driver answering a failed row remapping on one GPU (a line added
# to the host's NVML profile, which the library reads at each nvmlInit: what a driver reports).

NVML_PROFILE = "/etc/fleet-lab/nvml-profile"


def inject_fault(lab: LabFleet, index: int, gpu: int, xid: int, at: float) -> None:
    from fleetlab.hostfiles import NVML_STATE_DIR
    from fleetlab.nvml.faults import EVENTS_FILE, fault_line

    line = shlex.quote(fault_line(gpu, "xid", xid, at))
    must(lab, index, f"sudo -n sh -c {shlex.quote(f'printf %s {line} >> {NVML_STATE_DIR}/{EVENTS_FILE}')}")


def watch_state(lab: LabFleet, fleet: RolloutFleet, host: str) -> Any:
    from fleet.facts.runner import run_command
    from fleet.gpuwatch.state import parse_watch_state, watch_command

    _rc, out, _err = run_command(fleet.ssh[host], watch_command(), 30.0)
    return parse_watch_state(out.splitlines())


def test_an_xid_79_on_the_canarys_gpu_during_its_soak_fails_the_gpu_gate_and_gpu_clear_is_journaled(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """The canary loads release ``next`` and serves; about 3 s into its 15 s soak its GPU throws XID 79
    (fallen off the bus). ``/health`` stays 200, but the gpu gate reads the watcher's record: the
    canary fails, goes back to the release it ran, the rollout halts naming the XID and the GPU,
    and no other instance is touched. ``fleet gpu clear`` then lifts the quarantine, kept in the
    same journal as the rollout (``fleet history``), so the lab is clean for the tests after."""
    from fleet.gpuwatch.clear import clear_gpu

    lab, fleet = serving
    h0 = fleet.hosts[0]
    ref = next(r for r in fleet.instances if r.host == h0)
    canary, spec = str(ref), fleet.instances[ref]
    gpu = spec.gpus[0]
    assert must(lab, 0, "systemctl is-active fleet-gpu-watch.service").strip() == "active"
    assert watch_state(lab, fleet, h0).quarantined() == {}
    before = instance_state(lab, fleet)
    release = before[canary]["runs"]
    journal = tmp_path / "j.sqlite"
    argv = [str(FLEET), "rollout", fleet.inventory, "--release", "next", "--batches", "1,-1", "--soak", "15",
            "--probe-interval", "0.5", "--health-timeout", "60", "--json", "--journal", str(journal)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            _wait_for_step(journal, "start", 1, proc=proc)
            # soaking: the canary answers a real completion on the new release, and its gates
            # (probed every 0.5 s) have seen it; the fault comes at a chosen time 2 s from now
            assert wait_for(
                lambda: InstanceProber(spec.url, 5).completion(MODEL, "Reply with OK.", 1).status == 200, 60, 0.5
            )
            time.sleep(1.0)
            at = time.time() + 2.0
            inject_fault(lab, 0, gpu, 79, at)
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 1, out + err
        result = json.loads(out)
        assert result["status"] == "halted"
        reason = result["reason"]
        assert reason.startswith(f"batch 1 failed ({canary}: gpu gate: GPU {gpu} reported XID 79 (reboot)"), reason
        phases = {i["instance"]: i["phase"] for i in result["instances"]}
        assert phases == {canary: "rolled_back", **{n: "pending" for n in before if n != canary}}
        after = instance_state(lab, fleet)
        for name, inst in after.items():
            assert inst["unit"] == "active/running" and inst["runs"] == release, (name, inst)
            assert inst["serves"] == (MODEL,) and inst["current"] == release, (name, inst)
            assert (inst["pid"] != before[name]["pid"]) == (name == canary), (name, before[name], inst)
        # the journal names the XID and the GPU, and the canary's steps were the only ones
        data = history(result["id"], journal)
        assert data["status"] == "halted" and "XID 79" in data["reason"] and f"GPU {gpu}" in data["reason"]
        (failed,) = [i for i in data["instances"] if i["failure"]]
        assert failed["instance"] == canary and f"GPU {gpu} reported XID 79" in failed["failure"], failed
        assert {s["instance"] for s in data["steps"]} == {canary}
        # the watcher quarantined the GPU; the host's own record names the fault's time
        held = watch_state(lab, fleet, h0).quarantined()
        assert set(held) == {gpu} and (held[gpu].kind, held[gpu].xid) == ("xid", 79), held
        assert at - 1.0 <= held[gpu].at <= at + 30, (at, held[gpu])

        why = "GPU reseated and tested (lab)"
        rc, cleared = fleet_cli("gpu", "clear", fleet.inventory, h0, str(gpu), "--why", why, "--json", journal=journal)
        assert rc == 0, cleared
        assert watch_state(lab, fleet, h0).quarantined() == {}
        rc, listed = fleet_cli("history", "--json", journal=journal)
        assert rc == 0, listed
        kinds = {r["id"]: (r["kind"], r["status"]) for r in listed["rollouts"]}
        assert kinds == {result["id"]: ("rollout", "halted"), cleared["journal"]: ("gpu-clear", "done")}, kinds
        entry = history(cleared["journal"], journal)
        (step,) = entry["steps"]
        assert (step["instance"], step["action"], step["outcome"]) == (h0, "gpu:cleared", "ok"), step
        assert f"GPU {gpu} (" in step["detail"] and "cleared of XID 79 (reboot)" in step["detail"], step
        assert why in step["detail"] and "@" in step["detail"], step  # who (user@control-machine) and why
        assert entry["fleet"] == fleet.name
    finally:
        if watch_state(lab, fleet, h0).quarantined():  # left clean for the tests after, pass or fail
            clear_gpu(fleet.ssh[h0], gpu, "pytest", "test cleanup", time.time())
        ensure_serving(lab, fleet)


def test_a_critical_finding_refuses_fleet_deploy_on_its_host_before_anything_is_written(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """GPU 1 of the second host reports a failed row remapping (``row-remap-failed``, critical):
    ``fleet deploy`` refuses that host before writing anything to it (exit 1, naming the host, the
    GPU, the finding and ``--ignore-finding row-remap-failed``) and, within ``--fail-percent``,
    deploys the other (with the default 0 a refused host stops the others); a change the
    deploy would make on it (its watcher's record dir made 0711) is still there. With
    ``--ignore-finding row-remap-failed`` the deploy goes through and makes that change."""
    from fleet.render.gpuwatch import STATE_DIR

    lab, fleet = serving
    h0, h1 = fleet.hosts[0], fleet.hosts[1]
    saved = "/var/tmp/nvml-profile.before-test"
    before = instance_state(lab, fleet)
    must(lab, 1, f"test -f {NVML_PROFILE} && ! test -L {NVML_PROFILE} && sudo cp -p {NVML_PROFILE} {saved}")
    try:
        # a new profile file (a driver reload, as the library sees it) with GPU 1's remapping failed
        new = f"{NVML_PROFILE}.new"
        must(lab, 1, f"sudo sh -c 'cp {NVML_PROFILE} {new} && echo gpu.1.remapped_rows=0 1 0 1 >> {new} && "
                     f"mv {new} {NVML_PROFILE}' && sudo chmod 0711 {STATE_DIR}")  # fmt: skip

        def deploy(*args: str) -> tuple[int, dict[str, Any]]:
            proc = subprocess.run(
                [str(FLEET), "deploy", fleet.inventory, "--json", "--health-timeout", "120", *args],
                cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            try:
                return proc.returncode, json.loads(proc.stdout)
            except ValueError:
                raise AssertionError(proc.stdout + proc.stderr) from None

        rc, result = deploy("--fail-percent", "50")  # one refused host of two is within it: the other deploys
        assert rc == 1, result
        hosts = {h["host"]: h for h in result["hosts"]}
        assert hosts[h1]["status"] == "refused", hosts[h1]
        error = hosts[h1]["error"]
        assert "fleet deploy: refused by the audit before touching any host" in error, error
        assert f"{h1} GPU1: row-remap-failed (critical): row remapping failed" in error, error
        assert "RMA the GPU" in error and "--ignore-finding row-remap-failed" in error, error
        assert error.endswith("(nothing was written to the host)"), error
        assert hosts[h0]["status"] == "unchanged", hosts[h0]
        assert must(lab, 1, f"sudo stat -c %a {STATE_DIR}").strip() == "711"  # nothing was written
        assert {n: i["pid"] for n, i in instance_state(lab, fleet).items()} == {n: i["pid"] for n, i in before.items()}

        rc, result = deploy("--ignore-finding", "row-remap-failed")
        assert rc == 0, result
        hosts = {h["host"]: h for h in result["hosts"]}
        assert hosts[h1]["status"] == "changed" and "GPU watcher record dir" in hosts[h1]["operations"], hosts[h1]
        assert hosts[h0]["status"] == "unchanged", hosts[h0]
        assert must(lab, 1, f"sudo stat -c %a {STATE_DIR}").strip() == "700"
        assert {n: i["pid"] for n, i in instance_state(lab, fleet).items()} == {n: i["pid"] for n, i in before.items()}
    finally:
        on_host(lab, 1, f"sudo mv {saved} {NVML_PROFILE}; sudo chmod 0700 {STATE_DIR}")


def _wait_for_step(
    journal: Path, action: str, count: int, timeout: float = 120, proc: subprocess.Popen[Any] | None = None
) -> str:
    """The id of the rollout in ``journal`` once ``count`` ``action`` steps succeeded. With ``proc`` (the
    rollout's process), a process that ends first fails the wait at once, with what it printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the rollout exited {proc.returncode} before {count} {action} step(s):\n{out}\n{err}")
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
        rid = _wait_for_step(journal, "stop", 2, proc=proc)
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


CLAIM = "/var/lib/fleet/rollout-claim"


def claim_on(lab: LabFleet, index: int) -> str:
    """The host's claim file (root only), or "" when there is none."""
    return must(lab, index, f"sudo cat {CLAIM} 2>/dev/null || true")


def test_two_journals_the_second_is_refused_by_the_hosts_claims(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 27: two control machines (two SQLite journals) restart one fleet 2 s apart. The hosts'
    claims refuse the second before it touches anything, naming the first; the first finishes
    undisturbed (each instance restarted once) and clears its claims."""
    lab, fleet = serving
    before = instance_state(lab, fleet)
    first_journal, second_journal = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    argv = [str(FLEET), "restart", fleet.inventory, *FAST, "--journal", str(first_journal)]
    first = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rid = _wait_for_step(first_journal, "stop", 1)
        assert claim_on(lab, 0).startswith(f"rollout={rid}\n"), claim_on(lab, 0)
        rc, refused = fleet_cli("restart", fleet.inventory, *FAST, journal=second_journal)
        assert rc == 2, refused
        assert f"is being rolled by rollout {rid} by " in refused["error"], refused
        assert "nothing was touched" in refused["error"]
        with Journal(second_journal) as j:
            assert j.history() == []  # nothing journaled, nothing done
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    assert first.returncode == 0, out + err
    assert json.loads(out)["status"] == "done"
    with Journal(first_journal) as j:
        stops = [s.instance for s in j.steps(rid) if s.action == "stop"]
    assert sorted(stops) == sorted(before)  # each instance stopped once, by the first only
    after = instance_state(lab, fleet)
    assert_all_serving(before, after, before[next(iter(before))]["runs"])
    assert all(after[n]["pid"] != before[n]["pid"] for n in before)
    assert claim_on(lab, 0) == "" and claim_on(lab, 1) == ""  # cleared when it ended


def test_a_claim_left_by_a_rollout_elsewhere_holds_until_its_lease_runs_out(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    lab, fleet = serving
    h0 = fleet.hosts[0]
    before = instance_state(lab, fleet)
    write = (
        "sudo mkdir -p -m 700 /var/lib/fleet && printf 'rollout=20260101T000000Z-0ther0\\nmachine=jump-b\\n"
        "user=bob\\npid=4242\\nsince=1\\nlease_until=%s\\n' $(( $(date +%s) {} )) | sudo tee {} >/dev/null"
    )
    must(lab, 0, write.format("+ 600", CLAIM))
    try:
        rc, refused = fleet_cli("restart", fleet.inventory, "--limit", h0, *FAST, journal=tmp_path / "j.sqlite")
        assert rc == 2, refused
        assert refused["error"].startswith(
            f"host {h0} is being rolled by rollout 20260101T000000Z-0ther0 by bob@jump-b (pid 4242), its lease runs "
        ), refused
        assert {n: i["pid"] for n, i in instance_state(lab, fleet).items()} == {n: i["pid"] for n, i in before.items()}
        must(lab, 0, write.format("- 5", CLAIM))  # its owner died and never renewed it
        rc, result = fleet_cli("restart", fleet.inventory, "--limit", h0, *FAST, journal=tmp_path / "j.sqlite")
        assert rc == 0 and result["status"] == "done", result
        assert claim_on(lab, 0) == ""
    finally:
        must(lab, 0, f"sudo rm -f {CLAIM}")


def test_two_operators_share_a_postgresql_journal_the_second_resumes_when_the_first_dies(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 27: two control processes with their own HOMEs (one with FLEET_JOURNAL and ~/.pgpass,
    one with the journal config file and its password by reference) share a real PostgreSQL. The
    second is refused naming the first; the first is killed mid-rollout; the second resumes it."""
    from tests.postgres import private_cluster

    lab, fleet = serving
    before = instance_state(lab, fleet)
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    with private_cluster() as pg:
        alice.mkdir()
        pg.pgpass(alice)
        (bob / ".config" / "fleet").mkdir(parents=True)
        (bob / ".config" / "fleet" / "journal.toml").write_text(f'url = "{pg.url}"\npassword_ref = "env:FLEET_DB_PW"\n')
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "FLEET_JOURNAL", "XDG_"))}
        env_a = {**base, "HOME": str(alice), "FLEET_JOURNAL": pg.url}
        env_b = {**base, "HOME": str(bob), "FLEET_DB_PW": pg.password}

        def as_bob(*args: str) -> tuple[int, Any]:
            proc = subprocess.run([str(FLEET), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                                  env=env_b, check=False)  # fmt: skip
            try:
                return proc.returncode, json.loads(proc.stdout)
            except ValueError:
                return proc.returncode, proc.stdout + proc.stderr

        first = subprocess.Popen([str(FLEET), "restart", fleet.inventory, *FAST], cwd=REPO_ROOT, env=env_a,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            rid = ""
            while time.monotonic() < deadline and not rid:
                with contextlib.suppress(subprocess.CalledProcessError):  # no tables before its first write
                    rid = pg.superuser("SELECT rollout_id FROM steps WHERE action = 'stop' AND outcome = 'ok' LIMIT 1")
                time.sleep(0.2)
            assert rid, "the first never stopped an instance"
            rc, refused = as_bob("restart", fleet.inventory, *FAST)
            assert rc == 2, refused
            assert f"is locked by rollout {rid} by " in refused["error"] and f"(pid {first.pid})" in refused["error"]
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        rc, listed = as_bob("history", "--json")
        assert rc == 0 and [(r["id"], r["status"]) for r in listed["rollouts"]] == [(rid, "interrupted")], listed
        rc, result = as_bob("rollout", "--resume", rid, "--take-over", "--json")
        assert rc == 0, result
        assert result["status"] == "done" and result["id"] == rid
    after = instance_state(lab, fleet)
    assert_all_serving(before, after, before[next(iter(before))]["runs"])
    assert claim_on(lab, 0) == "" and claim_on(lab, 1) == ""


def test_rollback_to_the_previous_release_is_a_link_flip(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    lab, fleet = serving
    journal = tmp_path / "j.sqlite"
    first = must(lab, 0, f"ls {ROOT}/releases").split()
    original = next(r for r in first if r not in MADE)
    was = {i["runs"] for i in instance_state(lab, fleet).values()}
    assert len(was) == 1, was
    (start,) = was
    other = original if start == "next" else "next"
    rc, result = fleet_cli("rollout", fleet.inventory, "--release", other, *FAST, journal=journal)
    assert rc == 0 and result["status"] == "done", result
    listing = {i: must(lab, i, f"stat -c '%n %i %Y' {ROOT}/releases/*") for i in range(2)}
    before = instance_state(lab, fleet)
    assert all(i["runs"] == other for i in before.values())
    rc, back = fleet_cli("rollback", fleet.inventory, *FAST, journal=journal)
    assert rc == 0, back
    assert back["kind"] == "rollback" and back["status"] == "done"
    after = instance_state(lab, fleet)
    assert_all_serving(before, after, start)  # each instance back to what it ran before the rollout
    assert all(i["current"] == start for i in after.values())
    assert all(must(lab, i, f"readlink {ROOT}/previous").strip() == f"releases/{other}" for i in range(2))
    # no reinstall: the same release directories, same inodes, untouched
    assert {i: must(lab, i, f"stat -c '%n %i %Y' {ROOT}/releases/*") for i in range(2)} == listing
    # a second rollback is not a flip back onto the release the first one left: nothing changes
    rc, again = fleet_cli("rollback", fleet.inventory, *FAST, journal=journal)
    assert rc == 0 and again["status"] == "done", again
    assert all(i["phase"] == "done" and i["release"] == start for i in again["instances"]), again
    assert {n: i["pid"] for n, i in instance_state(lab, fleet).items()} == {n: i["pid"] for n, i in after.items()}


# ---- a halted release rollout, then status, rollback and deploy (issue 25.3) -------------------


def halt_with_a_canary_on_split(lab: LabFleet, fleet: RolloutFleet, journal: Path) -> dict[str, dict[str, Any]]:
    """Every instance on the inventory's release; then ``--release split``, a release that loads
    on the first host and crashes on the second: the canary (first host) stays on ``split``, the
    second batch fails on the second host and is rolled back (the first host's other instance with
    it), the rollout halts. The first host's ``current`` link names the old release again while its
    canary runs ``split``. Returns the instances' state before it."""
    h0, h1 = fleet.hosts
    original = next(r for r in must(lab, 0, f"ls {ROOT}/releases").split() if r not in MADE)
    if any(i["runs"] != original for i in instance_state(lab, fleet).values()):  # an earlier test's release
        # (in a journal of its own: this setup is not one of the changes a rollback below undoes)
        setup = journal.with_name("setup.sqlite")
        rc, result = fleet_cli("rollout", fleet.inventory, "--release", original, *FAST, journal=setup)
        assert rc == 0, result
    before = instance_state(lab, fleet)
    assert all(i["runs"] == original and i["unit"] == "active/running" for i in before.values()), before
    for i in range(2):
        must(lab, i, f"sudo rm -rf {ROOT}/releases/split")
    make_release(lab, 0, "split")
    make_release(lab, 1, "split", faults={"fail_load": [MODEL], "load_seconds": 1})
    # two at a time after the canary: the second batch holds the first host's other instance too, and
    # its rollback puts that host's current link back on the old release, under the canary's feet
    rc, result = fleet_cli("rollout", fleet.inventory, "--release", "split", *FAST, "--max-unavailable", "2",
                           journal=journal)  # fmt: skip
    assert rc == 1 and result["status"] == "halted", result
    phases = {i["instance"]: i["phase"] for i in result["instances"]}
    assert phases[f"{h0}/vllm-0"] == "done" and phases[f"{h1}/vllm-0"] == "rolled_back", phases
    state = instance_state(lab, fleet)
    assert state[f"{h0}/vllm-0"]["runs"] == "split" and state[f"{h0}/vllm-0"]["current"] == original, state
    assert all(state[n]["runs"] == original for n in state if n != f"{h0}/vllm-0"), state
    assert all(i["unit"] == "active/running" for i in state.values()), state
    return before


def test_after_a_halted_rollout_status_shows_what_each_instance_runs_and_rollback_sends_only_the_canary_back(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """The host's ``current`` link names the old release while its canary runs ``split``: status
    says what each process runs; ``fleet rollback INVENTORY`` sends the canary back to what *it*
    ran (the host links would send every instance to ``split``, which crashes on the second
    host) and touches no other instance."""
    lab, fleet = serving
    journal = tmp_path / "j.sqlite"
    h0 = fleet.hosts[0]
    canary = f"{h0}/vllm-0"
    halt_with_a_canary_on_split(lab, fleet, journal)
    truth = instance_state(lab, fleet)
    proc = subprocess.run([str(FLEET), "status", fleet.inventory, "--json", "--interval", "0.5"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    rows = {r["instance"]: r for r in json.loads(proc.stdout)["instances"]}
    assert set(rows) == set(truth), rows
    for name, row in rows.items():
        assert row["unit"]["release"] == truth[name]["runs"], (name, row["unit"], truth[name])
        assert row["unit"]["venv"] == f"{ROOT}/releases/{truth[name]['runs']}", (name, row["unit"])
    assert rows[canary]["unit"]["release"] == "split"
    rc, back = fleet_cli("rollback", fleet.inventory, *FAST, journal=journal)
    assert rc == 0 and back["status"] == "done", back
    assert [i["instance"] for i in back["instances"]] == [canary], back
    after = instance_state(lab, fleet)
    original = truth[f"{fleet.hosts[1]}/vllm-0"]["runs"]
    for name, inst in after.items():
        assert inst["unit"] == "active/running" and inst["runs"] == original and inst["serves"] == (MODEL,), (
            name,
            inst,
        )
        assert (inst["pid"] != truth[name]["pid"]) == (name == canary), (name, truth[name], inst)


def test_deploy_after_a_halted_rollout_converges_every_instance_in_one_run(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """The inventory's release is the one every instance ran; the canary stayed on ``split`` and
    its host's ``current`` link went back. One ``fleet deploy`` puts the canary back on the
    inventory's release through the engine, exit 0, and touches nothing else (by the link, the
    host looked converged: the deploy said "healthy" and left the canary where it was)."""
    lab, fleet = serving
    journal = tmp_path / "j.sqlite"
    h0, h1 = fleet.hosts
    canary = f"{h0}/vllm-0"
    before = halt_with_a_canary_on_split(lab, fleet, journal)
    halted = instance_state(lab, fleet)
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "timeouts": {"health": 60}}
    # releases_kept: the deploy keeps the releases the other tests made (it prunes beyond it)
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy, releases_kept=len(MADE) + 2)
    proc = subprocess.run(
        [str(FLEET), "deploy", inventory, "--json", "--health-timeout", "120"], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=900, check=False, env={**os.environ, "FLEET_JOURNAL": str(journal)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = {h["host"]: h for h in json.loads(proc.stdout)["hosts"]}
    assert result[h0]["restarted"] and any(
        op.startswith("rolled out vllm-0 (rollout") for op in result[h0]["operations"]
    )
    assert result[h1]["status"] == "unchanged" and not result[h1]["restarted"], result[h1]
    assert all(not h["drift"] for h in result.values()), result
    after = instance_state(lab, fleet)
    for name, inst in after.items():
        assert inst["unit"] == "active/running" and inst["serves"] == (MODEL,), (name, inst)
        assert inst["runs"] == before[name]["runs"], (name, inst)  # the inventory's release, every one
        assert (inst["pid"] != halted[name]["pid"]) == (name == canary), (name, halted[name], inst)


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


# ---- faults during a rollout, hooks on the host, a host that goes down ------------------------------


def inventory_with(fleet: RolloutFleet, path: Path, rollout: dict[str, Any], **data: Any) -> str:
    """A copy of the lab's inventory with ``rollout`` settings (and ``data``) on every host (group
    data, as an operator would set them); the hosts, their SSH settings and their serving data are
    unchanged."""
    import pprint
    import runpy

    hosts = runpy.run_path(fleet.inventory)["lab"]
    hosts = [(name, {**host_data, **data, "rollout": rollout}) for name, host_data in hosts]
    path.write_text(f"lab = {pprint.pformat(hosts, sort_dicts=False)}\n")
    return str(path)


def history(rollout_id: str, journal: Path) -> dict[str, Any]:
    rc, data = fleet_cli("history", rollout_id, "--json", journal=journal)
    assert rc == 0, data
    assert isinstance(data, dict), data
    return data


def test_alive_but_hung_canary_is_caught_by_the_completion_gate_and_rolled_back(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """The new release loads and answers ``/health`` 200 but never produces a token (an engine
    alive but hung, vllm#39863). Only a real completion sees it: the canary fails its completion
    gate, goes back to the release it ran, the rollout halts, and no other instance is touched."""
    lab, fleet = serving
    for i in range(len(fleet.hosts)):
        make_release(lab, i, "hung", faults={"hang_after_load": True, "load_seconds": 1})
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "probe_timeout_s": 1,
              "drain_timeout_s": 2, "timeouts": {"completion": 3}}  # fmt: skip
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    before = instance_state(lab, fleet)
    release = before[next(iter(before))]["runs"]
    journal = tmp_path / "j.sqlite"
    rc, result = fleet_cli("rollout", inventory, "--release", "hung", "--json", journal=journal)
    assert rc == 1, result
    canary = f"{fleet.hosts[0]}/vllm-0"
    assert result["status"] == "halted"
    assert result["reason"].startswith(
        f"batch 1 failed ({canary}: completion gate: completion: timed out after 1s (alive but not generating?)"
    ), result["reason"]
    assert "(timeouts.completion=3s)" in result["reason"]
    phases = {i["instance"]: i["phase"] for i in result["instances"]}
    assert phases == {canary: "rolled_back", **{n: "pending" for n in before if n != canary}}
    after = instance_state(lab, fleet)
    for name, inst in after.items():
        assert inst["unit"] == "active/running" and inst["runs"] == release, (name, inst)
        assert inst["serves"] == (MODEL,) and inst["current"] == release, (name, inst)
        assert (inst["pid"] != before[name]["pid"]) == (name == canary), (name, before[name], inst)
    # the old release serves for real again: a completion with tokens from the canary
    spec = fleet.instances[next(r for r in fleet.instances if str(r) == canary)]
    answer = InstanceProber(spec.url, 10).completion(MODEL, "Reply with OK.", 2)
    assert answer.status == 200 and answer.completion_tokens == 2, answer
    data = history(result["id"], journal)
    actions = ["stop", "flip", "start", "stop", "flip", "start"]
    assert [(s["instance"], s["action"]) for s in data["steps"]] == [(canary, a) for a in actions]
    assert all(s["outcome"] == "ok" for s in data["steps"])


def unit_times(lab: LabFleet, index: int, unit: str) -> dict[str, float]:
    """The unit's systemd timestamps (µs, UTC) as Unix seconds."""
    from datetime import UTC, datetime

    props = "ActiveEnterTimestamp,ActiveExitTimestamp,ExecMainStartTimestamp"
    out = must(lab, index, f"systemctl show --timestamp=us+utc -p {props} {unit}")
    times = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        stamp = datetime.strptime(value.strip(), "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=UTC)
        times[key] = stamp.timestamp()
    return times


def test_drain_and_undrain_hooks_run_on_the_host_around_each_restart(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """``hooks.on: host``: the hooks run on the instance's host as the SSH user (a stand-in for a
    local load balancer's admin command that logs what it was asked and when). The drain hook runs
    before systemd stops the unit, the undrain hook after the new process loaded (2 s) and soaked."""
    lab, fleet = serving
    h0 = fleet.hosts[0]
    hook = "/usr/local/bin/fleet-test-lb"
    log = "/var/tmp/fleet-test-lb.log"
    script = base64.b64encode(
        b'#!/bin/bash\nprintf \'%s %s %s\\n\' "$EPOCHREALTIME" "$(id -un)" "$*" >> ' + log.encode() + b"\n"
    ).decode()
    must(lab, 0, f"echo {script} | base64 -d | sudo tee {hook} >/dev/null && sudo chmod 755 {hook} && rm -f {log}")
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5,
              "hooks": {"drain": [hook, "drain", "{host}", "{instance}", "port={port}"],
                        "undrain": [hook, "undrain", "{host}", "{instance}", "port={port}"],
                        "on": "host", "timeout_s": 10}}  # fmt: skip
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    assert not Path(log).exists()  # the hooks must not run here
    before = instance_state(lab, fleet)
    journal = tmp_path / "j.sqlite"
    rc, result = fleet_cli("restart", inventory, "--limit", h0, "--health-timeout", "60", "--json", journal=journal)
    assert rc == 0, result
    after = instance_state(lab, fleet)
    assert_all_serving(before, after, before[f"{h0}/vllm-0"]["runs"])
    for name in after:
        assert (after[name]["pid"] != before[name]["pid"]) == name.startswith(f"{h0}/"), name
    lines = [line.split() for line in must(lab, 0, f"cat {log}").splitlines()]
    ports = {ref.instance: spec.port for ref, spec in fleet.instances.items() if ref.host == h0}
    assert [words[1:] for words in lines] == [
        [LOGIN_USER, "drain", h0, "vllm-0", f"port={ports['vllm-0']}"],
        [LOGIN_USER, "undrain", h0, "vllm-0", f"port={ports['vllm-0']}"],
        [LOGIN_USER, "drain", h0, "vllm-1", f"port={ports['vllm-1']}"],
        [LOGIN_USER, "undrain", h0, "vllm-1", f"port={ports['vllm-1']}"],
    ]
    at = [float(words[0]) for words in lines]
    for n, instance in enumerate(("vllm-0", "vllm-1")):
        times = unit_times(lab, 0, f"fleet-{instance}.service")
        drained, undrained = at[2 * n], at[2 * n + 1]
        assert drained < times["ActiveExitTimestamp"], (instance, drained, times)  # drained, then stopped
        assert times["ExecMainStartTimestamp"] > drained
        # back into traffic only after the model loaded (2 s) and every gate stayed green (soak 1 s)
        assert undrained >= times["ActiveEnterTimestamp"] + 3.0, (instance, undrained, times)
    with Journal(journal) as j:
        steps = [(s.instance, s.action) for s in j.steps(result["id"])]
        details = [s.detail for s in j.steps(result["id"]) if s.action.startswith("hook")]
    assert steps == [(f"{h0}/{i}", a) for i in ("vllm-0", "vllm-1")
                     for a in ("hook:drain", "stop", "start", "hook:undrain")]  # fmt: skip
    assert all(d.endswith("(hook runs on the host)") for d in details), details


def test_a_gate_that_flaps_during_the_soak_resets_it(serving: tuple[LabFleet, RolloutFleet], tmp_path: Path) -> None:
    """The new release serves, then its engine stalls for 2.5 s (no token; ``/health`` stays 200)
    and recovers: the completion gate goes green, red, green. The soak (6 s) starts again after the
    stall, so each instance takes at least load + stall + soak, and the journal counts the reset."""
    lab, fleet = serving
    h0 = fleet.hosts[0]
    # the stall must come after the completion gate's first green and inside the soak that follows
    # it: 3 s after ready leaves a loaded machine time to probe green first, and a 6 s soak from a green
    # at any time up to then is still running when the stall comes
    stall_after, stall, soak = 3.0, 2.5, 6.0
    make_release(lab, 0, "flappy",
                 faults={"stall_after_seconds": stall_after, "stall_seconds": stall, "load_seconds": 1})  # fmt: skip
    policy = {"batches": [1, -1], "soak_s": soak, "probe_interval_s": 0.5, "probe_timeout_s": 1,
              "timeouts": {"completion": 10}}  # fmt: skip
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    before = instance_state(lab, fleet)
    journal = tmp_path / "j.sqlite"
    rc, result = fleet_cli("rollout", inventory, "--release", "flappy", "--limit", h0, "--json", journal=journal)
    assert rc == 0, result
    assert result["status"] == "done"
    data = history(result["id"], journal)
    resets = {i["instance"]: i["soak_resets"] for i in data["instances"]}
    assert resets[f"{h0}/vllm-0"] >= 1 and resets[f"{h0}/vllm-1"] >= 1, resets
    steps = data["steps"]
    started = next(s["at"] for s in steps if s["instance"] == f"{h0}/vllm-0" and s["action"] == "start")
    next_stop = next(s["at"] for s in steps if s["instance"] == f"{h0}/vllm-1" and s["action"] == "stop")
    # loaded (1 s), soaking when the stall came (3 s after ready), the stall (2.5 s), a full soak after it
    assert next_stop - started >= 1 + stall_after + stall + soak - 0.5, (started, next_stop)
    after = instance_state(lab, fleet)
    for name, inst in after.items():
        assert inst["unit"] == "active/running" and inst["serves"] == (MODEL,), (name, inst)
        assert inst["restarts"] == before[name]["restarts"], (name, inst)
        if name.startswith(f"{h0}/"):
            assert inst["runs"] == "flappy" and inst["pid"] != before[name]["pid"], (name, inst)
        else:
            assert inst == before[name], name  # never touched
    rc, out, _ = on_host(
        lab, 0, "sudo journalctl -u fleet-vllm-0.service -o cat --no-pager | grep -c 'engine steps stall'"
    )
    assert rc == 0 and int(out) >= 1  # the stall did happen on the host


# ---- a host that stops answering, a second Ctrl-C, a changed host key, concurrent switches --------
#
# A partition that cuts only fleet off from one lab host: the command under test runs in a cgroup
# of its own, and an nftables output rule drops that cgroup's packets to the host's address
# (``socket cgroupv2``, as the lab's air gap matches hosts: ``fleetlab/airgap.py``); the lab's
# hosts keep reaching their own addresses. A frozen host: its cgroup's ``cgroup.freeze`` (cgroup
# v2), every process of it stopped while its kernel still answers TCP.

DECIDE_WITHIN_S = 30.0


@contextmanager
def own_cgroup(name: str) -> Iterator[Path]:
    """A cgroup (v2) of this test's own, below this process's (so what guards the test run's
    cgroup, the network guard of tests/conftest.py, guards it too); removed at the end (its
    processes are gone by then)."""
    from fleetlab.airgap import cgroup2_root

    root = cgroup2_root()
    assert root is not None, "no cgroup v2 hierarchy"
    mine = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    path = root / mine.strip("/") / f"fleet-test-{os.getpid()}-{name}"
    path.mkdir()
    try:
        yield path
    finally:
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def fleet_in(cgroup: Path, *args: str, log: Path) -> subprocess.Popen[str]:
    """``fleet ARGS`` started inside ``cgroup`` (so every socket it opens is that cgroup's)."""
    argv = ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", str(cgroup), str(FLEET), *args]
    env = {**os.environ, "FLEET_LOG": str(log)}
    return subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@contextmanager
def partition(cgroup: Path, address: str) -> Iterator[Callable[[], str]]:
    """Yields ``cut()``: from then on every packet ``cgroup``'s sockets send to ``address`` is
    dropped (no answer, no error: a partition). The rule is removed at the end, pass or fail.
    ``cut()`` returns the nft table's name, to read its counter."""
    from fleetlab.airgap import host_rule

    rule = host_rule("fleet-under-test", address, cgroup)
    table = f"fleet_test_{os.getpid()}"
    script = (
        f"table inet {table} {{\n  chain output {{\n    type filter hook output priority filter; policy accept;\n"
        f'    socket cgroupv2 level {rule.level} "{rule.cgroup}" ip daddr {address} counter drop\n  }}\n}}\n'
    )

    def cut() -> str:
        done = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        return table

    try:
        yield cut
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, check=False)


def dropped(table: str) -> int:
    """Packets the partition dropped so far."""
    out = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True, check=True).stdout
    return int(out.split("counter packets ")[1].split()[0])


@contextmanager
def frozen(lab: LabFleet, index: int) -> Iterator[Callable[[], None]]:
    """Yields ``freeze()``: every process of the host stops (cgroup v2 ``cgroup.freeze``); thawed
    at the end, pass or fail."""
    from fleetlab.airgap import host_cgroup
    from fleetlab.lab import machine_for

    state = lab.state
    m = machine_for(lab.dir, state, state.hosts[index])
    cgroup = host_cgroup(m.name, m.pid())
    assert cgroup is not None and (cgroup / "cgroup.freeze").exists(), cgroup

    def freeze() -> None:
        (cgroup / "cgroup.freeze").write_text("1\n")

    try:
        yield freeze
    finally:
        (cgroup / "cgroup.freeze").write_text("0\n")


def slow_stop(lab: LabFleet, index: int, unit: str, seconds: int) -> str:
    """Make ``systemctl stop UNIT`` take ``seconds`` on the host (``ExecStopPost=`` runs within the
    stop job), as a vLLM draining for its ``--shutdown-timeout`` does; returns the drop-in's path."""
    dropin = f"/etc/systemd/system/{unit}.d/zz-test-slow-stop.conf"
    must(lab, index, f"sudo mkdir -p /etc/systemd/system/{unit}.d && printf '[Service]\\nExecStopPost=/bin/sleep "
                     f"{seconds}\\n' | sudo tee {dropin} >/dev/null && sudo systemctl daemon-reload")  # fmt: skip
    return dropin


def unit_state_on_host(lab: LabFleet, index: int, unit: str) -> str:
    """``ActiveState/SubState`` read over the test's own SSH connection (outside any partition)."""
    out = must(lab, index, f"systemctl show -p ActiveState,SubState --value {unit}").split()
    return "/".join(out)


def ensure_serving(lab: LabFleet, fleet: RolloutFleet) -> None:
    """Every instance started and serving again (after a test that may have left one down)."""
    for i, host in enumerate(fleet.hosts):
        units = " ".join(spec.unit for ref, spec in fleet.instances.items() if ref.host == host)
        must(lab, i, f"sudo systemctl reset-failed {units} 2>/dev/null; sudo systemctl start {units}")
    assert wait_for(
        lambda: all(
            i["unit"] == "active/running" and i["serves"] == (MODEL,) for i in instance_state(lab, fleet).values()
        ),
        120,
        1.0,
    ), instance_state(lab, fleet)


def _wait_for_intent(journal: Path, instance: str, action: str, timeout: float = 120) -> tuple[str, float]:
    """The rollout id and the time a step was journaled (before it is taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if journal.exists():
            with Journal(journal) as j:
                for r in j.history():
                    hit = [s for s in j.steps(r.id) if s.instance == instance and s.action == action]
                    if hit:
                        return r.id, hit[0].at
        time.sleep(0.1)
    raise AssertionError(f"no {action} of {instance} within {timeout}s")


def _no_library_noise(err: str) -> None:
    assert "Traceback" not in err and "paramiko" not in err and "Exception (client)" not in err, err
    assert "ssh-keygen -R 1" not in err, err  # pyinfra's advice (it edits ~/.ssh/known_hosts)


def test_a_host_cut_off_while_its_stop_runs_halts_the_restart_within_30_s_naming_it(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 25.1: packets to one host dropped while ``systemctl stop`` of its instance runs (a
    20 s drain). Before, the step waited as long as the partition lasted. Now the SSH heartbeat
    goes unanswered, the step fails, and the restart halts within 30 s naming the host as
    unreachable; the instance it stopped is named as not serving."""
    lab, fleet = serving
    h0, h1 = fleet.hosts
    target = f"{h1}/vllm-0"
    unit = fleet.instances[next(r for r in fleet.instances if str(r) == target)].unit
    before = instance_state(lab, fleet)
    dropin = slow_stop(lab, 1, unit, 20)
    journal = tmp_path / "j.sqlite"
    args = ["restart", fleet.inventory, "--batches", "1", "--soak", "1", "--probe-interval", "0.5",
            "--health-timeout", "60", "--json", "--journal", str(journal)]  # fmt: skip
    try:
        with own_cgroup("cut") as cgroup, partition(cgroup, lab.state.hosts[1].address) as cut:
            proc = fleet_in(cgroup, *args, log=tmp_path / "fleet.log")
            try:
                rid, _at = _wait_for_intent(journal, target, "stop")
                # the stop reached the host and runs there (vLLM's drain, then the ExecStopPost sleep)
                assert wait_for(lambda: unit_state_on_host(lab, 1, unit).startswith("deactivating"), 30, 0.1)
                table = cut()
                cut_at = time.monotonic()
                out, err = proc.communicate(timeout=120)
                took = time.monotonic() - cut_at
                assert dropped(table) > 0  # the partition did drop fleet's packets
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
        assert proc.returncode == 1, out + err
        assert took <= DECIDE_WITHIN_S, took
        print(f"partitioned during systemctl stop: halted {took:.1f}s after the cut")
        _no_library_noise(err)
        result = json.loads(out)
        assert result["status"] == "halted" and result["id"] == rid
        reason = result["reason"]
        assert reason.startswith(f"batch 2 failed ({target}: stop failed: host {h1}: SSH failed: unreachable: "), reason
        assert "no answer to SSH keepalives for 1" in reason and "during `systemctl stop -- " in reason, reason
        phases = {i["instance"]: i["phase"] for i in result["instances"]}
        assert phases == {f"{h0}/vllm-0": "done", target: "failed", f"{h0}/vllm-1": "pending",
                          f"{h1}/vllm-1": "pending"}  # fmt: skip
        assert any(line.startswith(f"{target} is not serving: this rollout stopped it and it is not back")
                   for line in result["next"]), result["next"]  # fmt: skip
        # every instance's end state (the partition is gone: fleet's view of the host is back)
        after = instance_state(lab, fleet)
        assert after[f"{h0}/vllm-0"]["unit"] == "active/running" and after[f"{h0}/vllm-0"]["pid"] != before[
            f"{h0}/vllm-0"]["pid"]  # fmt: skip
        for name in (f"{h0}/vllm-1", f"{h1}/vllm-1"):
            assert after[name]["unit"] == "active/running" and after[name]["pid"] == before[name]["pid"], name
        # the stop it sent finished on the host: the instance is down, as the output says
        assert wait_for(lambda: instance_state_of_host(lab, fleet, 1)[target]["unit"].split("/")[0] in (
            "inactive", "failed"), 40), instance_state_of_host(lab, fleet, 1)[target]  # fmt: skip
    finally:
        must(lab, 1, f"sudo rm -f {dropin} && sudo systemctl daemon-reload")
        ensure_serving(lab, fleet)


def test_a_host_frozen_mid_restart_is_skipped_within_30_s_and_the_rest_restarts(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 19.8: the host's cgroup frozen after the canary started. Before, the restart said
    nothing for 2.5 min and then waited for the host until it was thawed. Now its instances are
    skipped (never touched) once it has not answered for ``unreachable_timeout_s``, the other
    host's instance restarts within the budget (``--max-unavailable 3``), and the restart ends
    halted, exit 1, naming the host and what to run once it answers."""
    lab, fleet = serving
    h0, h1 = fleet.hosts
    before = instance_state(lab, fleet)
    journal = tmp_path / "j.sqlite"
    args = ["restart", fleet.inventory, "--batches", "1,-1", "--max-unavailable", "3", "--soak", "1",
            "--probe-interval", "0.5", "--health-timeout", "60", "--json", "--journal", str(journal)]  # fmt: skip
    env = {**os.environ, "FLEET_LOG": str(tmp_path / "fleet.log")}
    try:
        with frozen(lab, 1) as freeze:
            proc = subprocess.Popen([str(FLEET), *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
            try:
                rid, _at = _wait_for_intent(journal, f"{h0}/vllm-0", "start")
                freeze()
                frozen_at = time.time()
                out, err = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
        after = instance_state(lab, fleet)  # thawed: every instance's end state
    finally:
        ensure_serving(lab, fleet)
    assert proc.returncode == 1, out + err
    _no_library_noise(err)
    result = json.loads(out)
    assert result["status"] == "halted" and result["id"] == rid
    assert result["reason"] == (
        f"2 instance(s) skipped, never touched: host(s) {h1} unreachable ({h1}/vllm-0, {h1}/vllm-1); "
        "every other instance is done"
    ), result["reason"]
    phases = {i["instance"]: i["phase"] for i in result["instances"]}
    assert phases == {f"{h0}/vllm-0": "done", f"{h0}/vllm-1": "done", f"{h1}/vllm-0": "skipped",
                      f"{h1}/vllm-1": "skipped"}  # fmt: skip
    skipped = next(i for i in result["instances"] if i["instance"] == f"{h1}/vllm-0")
    assert skipped["failure"].startswith(f"skipped: host {h1} unreachable for "), skipped
    assert "SSH failed: unreachable: " in skipped["failure"], skipped
    assert f"not touched, host {h1} did not answer: {h1}/vllm-0, {h1}/vllm-1; once it does, run the restart " \
           f"again for it (`--limit {h1}`)" in result["next"]  # fmt: skip
    with Journal(journal) as j:
        went_on = next(s.at for s in j.steps(rid) if s.instance == f"{h0}/vllm-1" and s.action == "stop")
        assert not [s for s in j.steps(rid) if s.instance and s.instance.startswith(f"{h1}/")]  # never touched
    decided = went_on - frozen_at  # the skip was decided, and the next instance stopped, this long after
    print(f"frozen after the canary started: skipped and went on {decided:.1f}s after the freeze")
    assert decided <= DECIDE_WITHIN_S, decided
    for name, inst in after.items():
        assert inst["unit"] == "active/running" and inst["serves"] == (MODEL,), (name, inst)
        assert (inst["pid"] != before[name]["pid"]) == name.startswith(f"{h0}/"), (name, before[name], inst)


def test_a_host_frozen_before_a_restart_exits_1_naming_it_and_status_says_why_in_one_line(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 19.8/25.8: with a host frozen before the command, restart exited 2 ("invalid input")
    after 21 s and both it and ``fleet status`` printed paramiko's traceback ("Exception (client):
    Error reading SSH protocol banner"); status's reason was paramiko's "No existing session"."""
    lab, fleet = serving
    h1 = fleet.hosts[1]
    before = instance_state(lab, fleet)
    env = {**os.environ, "FLEET_LOG": str(tmp_path / "fleet.log")}
    with frozen(lab, 1) as freeze:
        freeze()
        t0 = time.monotonic()
        restart = subprocess.run([str(FLEET), "restart", fleet.inventory, "--journal", str(tmp_path / "j.sqlite")],
                                 cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        took = time.monotonic() - t0
        status = subprocess.run([str(FLEET), "status", fleet.inventory, "--json"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert restart.returncode == 1, restart.stdout + restart.stderr
    print(f"restart with a frozen host: exit 1 after {took:.1f}s")
    assert took < DECIDE_WITHIN_S
    _no_library_noise(restart.stderr)
    lines = [line for line in restart.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1, lines  # one line: the host, "unreachable", why, and that nothing changed
    assert lines[0].startswith(f"error: host {h1}: SSH failed: unreachable: "), lines[0]
    assert "took the TCP connection but the SSH handshake did not finish within 10s" in lines[0]
    assert lines[0].endswith("(nothing was changed)"), lines[0]
    assert status.returncode == 1, status.stdout + status.stderr
    _no_library_noise(status.stderr)
    rows = {r["host"] + "/" + r["instance"]: r for r in json.loads(status.stdout)["instances"]}
    for name, row in rows.items():
        if name.startswith(f"{h1}/"):
            assert row["unit"]["state"] == "unreachable", row
            assert "took the TCP connection but the SSH handshake did not finish" in row["unit"]["detail"], row
            assert "No existing session" not in json.dumps(row)
    assert "Error reading SSH protocol banner" in (tmp_path / "fleet.log").read_text()  # the details: in the log
    after = instance_state(lab, fleet)
    assert {n: i["pid"] for n, i in after.items()} == {n: i["pid"] for n, i in before.items()}  # nothing changed


def test_a_second_ctrl_c_names_what_is_down_and_how_to_resume_and_the_journal_says_interrupted(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 25.5: a second Ctrl-C printed only "Aborted!", left the journal "running" and named
    nothing. The first Ctrl-C waits for the step in progress (a stop draining for 20 s); the second
    aborts at once: the instance being stopped is named as down, the resume command is printed,
    an ``interrupted`` step is journaled, and the lock is released; the resume finishes it."""
    lab, fleet = serving
    h0 = fleet.hosts[0]
    target = f"{h0}/vllm-0"
    unit = fleet.instances[next(r for r in fleet.instances if str(r) == target)].unit
    dropin = slow_stop(lab, 0, unit, 20)
    journal = tmp_path / "j.sqlite"
    argv = [str(FLEET), "restart", fleet.inventory, "--batches", "1", "--soak", "1", "--probe-interval", "0.5",
            "--health-timeout", "60", "--journal", str(journal)]  # fmt: skip
    env = {**os.environ, "FLEET_LOG": str(tmp_path / "fleet.log")}
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        rid, _at = _wait_for_intent(journal, target, "stop")
        assert wait_for(lambda: unit_state_on_host(lab, 0, unit).startswith("deactivating"), 30, 0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        must(lab, 0, f"sudo rm -f {dropin} && sudo systemctl daemon-reload")
    try:
        print(f"second SIGINT: exited {took:.1f}s later")
        assert proc.returncode == 1, out + err
        assert took < 5, took
        _no_library_noise(err)
        assert "Aborted!" not in err
        assert "SIGINT: stopping after the step in progress (again to abort at once)" in err
        assert f"restart {rid} aborted during a step (second signal (SIGINT, then SIGINT))" in err, err
        assert f"{target}: not serving: this rollout stopped it and it is not back (last step: stop)" in err, err
        assert f"resume with: fleet rollout --resume {rid}" in err, err
        with Journal(journal) as j:
            assert j.latest_state(rid).status.value == "running"  # resumable
            assert j.lock_owner(fleet.name) is None  # released: no --take-over needed
            marks = [s for s in j.steps(rid) if s.action == "interrupted"]
            assert len(marks) == 1 and marks[0].outcome == "interrupted", marks
            assert marks[0].detail.startswith("aborted during a step on a second signal (SIGINT, then SIGINT)")
            assert marks[0].detail.endswith(f"not serving (stopped by this rollout, not back): {target}")
        rc, done = fleet_cli("rollout", "--resume", rid, "--json", journal=journal)
        assert rc == 0 and done["status"] == "done", done
        for name, inst in instance_state(lab, fleet).items():
            assert inst["unit"] == "active/running" and inst["serves"] == (MODEL,), (name, inst)
    finally:
        ensure_serving(lab, fleet)


def test_a_changed_host_key_shows_both_fingerprints_and_the_right_known_hosts_file(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 25.7: the advice was pyinfra's ``ssh-keygen -R ADDR`` (it edits ~/.ssh/known_hosts, not
    the inventory's ``ssh_known_hosts_file``), the keys were shown with parts redacted, and restart
    exited 2. Now: SHA256 fingerprints (expected and offered), ``ssh-keygen -R ... -f FILE``, exit 1."""
    import runpy

    from fleetlab.lab import machine_for

    lab, fleet = serving
    h1 = fleet.hosts[1]
    before = instance_state(lab, fleet)
    known = lab.dir.known_hosts.read_text().splitlines()
    address = lab.state.hosts[1].address
    port = lab.state.ssh_port
    entry = address if port == 22 else f"[{address}]:{port}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True)
    impostor = (tmp_path / "impostor.pub").read_text().split()
    changed = [f"{entry} {impostor[0]} {impostor[1]}" if line.split()[0] == entry else line for line in known]
    assert changed != known
    (tmp_path / "known_hosts").write_text("\n".join(changed) + "\n")
    hosts = runpy.run_path(fleet.inventory)["lab"]
    hosts = [(name, {**data, "ssh_known_hosts_file": str(tmp_path / "known_hosts")}) for name, data in hosts]
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"lab = {hosts!r}\n")

    def fingerprint(pub: Path) -> str:
        return subprocess.run(
            ["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True
        ).stdout.split()[1]

    expected = fingerprint(tmp_path / "impostor.pub")
    m = machine_for(lab.dir, lab.state, lab.state.hosts[1])
    offered = fingerprint(m.host_key.with_suffix(".pub"))
    env = {**os.environ, "FLEET_LOG": str(tmp_path / "fleet.log")}
    rc, result = fleet_cli("restart", str(inventory), "--json", journal=tmp_path / "j.sqlite")
    assert rc == 1, result
    error = result["error"]
    assert error.startswith(f"host {h1}: SSH failed: the host key of {entry} has changed: "), error
    assert f"{tmp_path / 'known_hosts'} holds ED25519 {expected}, the host offered ED25519 {offered}" in error
    assert f"`ssh-keygen -R {shlex.quote(entry)} -f {tmp_path / 'known_hosts'}`" in error, error
    assert "<redacted>" not in error and "~/.ssh" not in error and error.endswith("(nothing was changed)")
    deploy = subprocess.run([str(FLEET), "deploy", str(inventory), "--dry", "--limit", h1, "--json"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert deploy.returncode == 1, deploy.stdout + deploy.stderr
    _no_library_noise(deploy.stderr)
    (row,) = json.loads(deploy.stdout)["hosts"]
    assert row["status"] == "unreachable" and f"the host offered ED25519 {offered}" in row["error"], row
    assert f"-f {tmp_path / 'known_hosts'}" in row["error"] and "<redacted>" not in row["error"], row
    after = instance_state(lab, fleet)
    assert {n: i["pid"] for n, i in after.items()} == {n: i["pid"] for n, i in before.items()}


def test_concurrent_release_switches_on_one_host_never_collide(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Issue 25.2: two instances of one host switching in one batch wrote the same temporary link
    2-3 ms apart (``mv: cannot stat``) and the batch's rollback hit the same. 50 rounds of 2-4
    concurrent ``flip_release`` calls through the executor on one host (its own root beside the
    real one): every call succeeds and ``current``/``previous`` are valid links after each round."""
    from concurrent.futures import ThreadPoolExecutor

    from fleet.facts.releases import MARKER
    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.ssh_executor import InstanceSpec, SshExecutor

    lab, fleet = serving
    host = fleet.hosts[0]
    root = f"/var/tmp/fleet-switch-test-{os.getpid()}"
    must(lab, 0, f"sudo mkdir -p {root}/releases/a {root}/releases/b && sudo touch {root}/releases/a/{MARKER} "
                 f"{root}/releases/b/{MARKER}")  # fmt: skip
    refs = [InstanceRef(host, f"vllm-{i}") for i in range(4)]
    specs = {r: InstanceSpec(r, f"fleet-{r.instance}.service", "http://127.0.0.1:1", 1, (0,), MODEL) for r in refs}
    executor = SshExecutor({host: fleet.ssh[host]}, specs, root=root)
    try:
        with ThreadPoolExecutor(4) as pool:
            for n in range(50):
                release, other = ("a", "b") if n % 2 else ("b", "a")
                width = 2 + n % 3
                outcomes = list(pool.map(lambda r, rel=release: _flip(executor, r, rel), refs[:width]))
                assert outcomes == ["ok"] * width, (n, outcomes)
                current, previous = executor.links(host)
                assert current == release and (n == 0 or previous == other), (n, current, previous)
        left = must(lab, 0, f"ls -A {root}").split()
        assert sorted(left) == [".fleet-switch.lock", "current", "previous", "releases"], left  # no temporary link
    finally:
        executor.close()
        must(lab, 0, f"sudo rm -rf {root}")


def _flip(executor: Any, ref: Any, release: str) -> str:
    try:
        executor.flip_release(ref, release)
    except FleetError as exc:
        return str(exc)
    return "ok"


# ---- a load balancer in the loop: a restart that clients never notice ------------------------------


class Load:
    """Clients of the balancer, with the ``openai`` client (no retries of its own: a failure counts):
    mixed short and long completions, streaming and not, each worker in a loop until stopped.
    Failed: an HTTP error, a broken connection, ``finish_reason: "abort"``, a stream that ends
    without its finishing chunk."""

    def __init__(self, url: str, workers: int = 8) -> None:
        import threading

        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(workers)]

    def _one(self, i: int, n: int) -> str | None:
        long = (i + n) % 3 == 0
        tokens = 400 if long else 16
        if (i + n) % 2:
            stream = self.client.completions.create(model=MODEL, prompt=f"load {i} {n}", max_tokens=tokens,
                                                    stream=True)  # fmt: skip
            finish = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish is None:
                return "stream ended without a finish_reason (truncated)"
        else:
            answer = self.client.completions.create(model=MODEL, prompt=f"load {i} {n}", max_tokens=tokens)
            finish = answer.choices[0].finish_reason
        return None if finish in ("length", "stop") else f"finish_reason {finish!r}"

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                why = self._one(i, n)
            except Exception as exc:  # every error the client raises is a failed request
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
            with self.lock:
                if why is None:
                    self.ok += 1
                else:
                    self.failed.append(why)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def lb_views(inventory: str) -> dict[str, dict[str, Any]]:
    rc, out = fleet_json("lb", "show", inventory, "--json")
    assert rc == 0, out
    return {r["instance"]: r for r in out["servers"]}


def test_a_restart_under_load_behind_the_balancer_fails_no_request(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """HAProxy (the lab's, fleet's configuration) in front of the 4 instances, 8 clients of the
    ``openai`` client through it, then ``fleet restart``: every instance leaves traffic (drain),
    its sessions end, it restarts, passes its gates and comes back; not one request fails. Then
    the same restart with ``--no-lb`` (the balancer keeps sending to draining instances, which
    answer HTTP 500 as vLLM does): requests fail, which shows the first count is not vacuous."""
    from fleetlab import balancer

    lab, fleet = serving
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "drain_timeout_s": 30}
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    hosts = runpy_hosts(inventory)
    entry = balancer.balancer_entry(lab.dir, lab.state)
    Path(inventory).write_text(f"lab = {[(n, {**d, 'balancer': entry}) for n, d in hosts]!r}\n")
    url = balancer.ensure(lab.dir, Path(inventory))
    try:
        refs = [str(r) for r in fleet.instances]
        assert set(lb_views(inventory)) == set(refs)
        assert {v["view"] for v in lb_views(inventory).values()} <= {"MAINT"}  # written disabled
        rc, out = fleet_json("lb", "ready", inventory, *refs, "--json")
        assert rc == 0, out
        assert wait_until(lambda: {v["view"] for v in lb_views(inventory).values()} == {"UP"}, 30), lb_views(inventory)
        before = instance_state(lab, fleet)
        journal = tmp_path / "j.sqlite"
        with Load(url) as load:
            time.sleep(3)
            assert load.ok > 0 and not load.failed, load.failed
            t0 = time.monotonic()
            rc, result = fleet_cli("restart", inventory, "--health-timeout", "60", "--json", journal=journal)
            took = time.monotonic() - t0
            time.sleep(2)
        assert rc == 0, result
        assert result["status"] == "done"
        print(f"\nrestart of 4 instances under load behind HAProxy: {took:.1f}s, {load.ok} requests, "
              f"{len(load.failed)} failed")  # fmt: skip
        assert load.failed == [], load.failed[:10]
        assert load.ok >= 20
        after = instance_state(lab, fleet)
        for r in refs:  # each on the release it ran before (an earlier test leaves the hosts on two releases)
            assert_all_serving({r: before[r]}, {r: after[r]}, before[r]["runs"])
        assert all(after[r]["pid"] != before[r]["pid"] for r in refs)  # every instance restarted
        with Journal(journal) as j:
            steps = [(s.instance, s.action) for s in j.steps(result["id"])]
        for r in refs:
            assert [a for i, a in steps if i == r] == ["lb:drain", "stop", "start", "lb:ready"], (r, steps)
        assert {v["view"] for v in lb_views(inventory).values()} == {"UP"}

        # the control: the same restart with --no-lb; its drain never sees 0 requests under traffic
        # (issue 18), so a short drain_timeout_s keeps it from waiting 30 s per batch
        control = tmp_path / "control.py"
        control.write_text(Path(inventory).read_text().replace("'drain_timeout_s': 30", "'drain_timeout_s': 3"))
        assert "'drain_timeout_s': 3}" in control.read_text()
        with Load(url) as load:
            time.sleep(1)
            proc = subprocess.run(
                [str(FLEET), "restart", str(control), "--no-lb", "--health-timeout", "60", "--json", "--journal",
                 str(tmp_path / "j2.sqlite")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            time.sleep(1)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "--no-lb: nothing takes an instance out of traffic" in proc.stderr
        print(f"the same restart with --no-lb: {load.ok} requests, {len(load.failed)} failed")
        assert load.failed, "without the balancer in the loop some request must fail"
    finally:
        balancer.stop(lab.dir)


def test_drain_takes_a_host_out_under_load_a_restart_from_another_journal_skips_it_undrain_brings_it_back(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Behind the lab's HAProxy, under load: ``fleet drain`` of one host marks it on the host
    (root-only, who/when/why), takes its instances out of traffic, stops and disables their units
    and leaves their servers in MAINT, failing no request. A ``fleet restart`` with another journal
    (another control machine's) skips that host by its marker, says so, and restarts only the
    other; ``fleet deploy --limit`` of it reports it skipped and exits 0; ``fleet status`` shows it
    drained with the balancer's view. ``fleet undrain`` starts, gates and puts it back, failing no
    request, and removes the marker."""
    from fleetlab import balancer

    lab, fleet = serving
    h0, h1 = fleet.hosts
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "drain_timeout_s": 30}
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    entry = balancer.balancer_entry(lab.dir, lab.state)
    Path(inventory).write_text(f"lab = {[(n, {**d, 'balancer': entry}) for n, d in runpy_hosts(inventory)]!r}\n")
    url = balancer.ensure(lab.dir, Path(inventory))
    mine = [r for r in map(str, fleet.instances) if r.startswith(f"{h1}/")]
    others = [r for r in map(str, fleet.instances) if r.startswith(f"{h0}/")]
    units = [s.unit for r, s in fleet.instances.items() if r.host == h1]
    drained = False
    try:
        rc, out = fleet_json("lb", "ready", inventory, *mine, *others, "--json")
        assert rc == 0, out
        assert wait_until(lambda: {v["view"] for v in lb_views(inventory).values()} == {"UP"}, 30), lb_views(inventory)
        before = instance_state(lab, fleet)
        j1, j2 = tmp_path / "control-1.sqlite", tmp_path / "control-2.sqlite"
        with Load(url, workers=4) as load:
            time.sleep(2)
            rc, result = fleet_cli("drain", inventory, h1, "--reason", "swap the NVMe, ticket 4411", "--json",
                                   journal=j1)  # fmt: skip
            drained = True
            time.sleep(1)
        assert rc == 0, result
        assert result["status"] == "done", result
        assert load.failed == [] and load.ok > 0, load.failed[:10]
        marker = must(
            lab, 1, "sudo stat -c '%a %U' /var/lib/fleet/drained.json && sudo cat /var/lib/fleet/drained.json"
        )
        mode, _, text = marker.partition("\n")
        assert mode == "600 root", mode
        body = json.loads(text)
        assert body["reason"] == "swap the NVMe, ticket 4411" and body["rollout"] == result["id"]
        assert body["by"].endswith("@" + os.uname().nodename) and abs(body["at"] - time.time()) < 300
        rc, _o, _e = on_host(lab, 1, "test -r /var/lib/fleet/drained.json")
        assert rc != 0  # root-only: the login user cannot read it
        for unit in units:
            assert must(lab, 1, f"systemctl is-active {unit} || true").strip() == "inactive"
            assert must(lab, 1, f"systemctl is-enabled {unit} || true").strip() == "disabled"
        views = lb_views(inventory)
        assert {views[r]["view"] for r in mine} == {"MAINT"} and {views[r]["view"] for r in others} == {"UP"}, views
        steps = [(s["instance"], s["action"], s["outcome"]) for s in history(result["id"], j1)["steps"]]
        assert (h1, "marker:drained", "ok") == steps[0], steps
        for r in mine:
            assert [a for i, a, _o in steps if i == r] == ["lb:drain", "stop", "lb:maint"], steps
        assert (h1, "units:disabled", "ok") in steps, steps

        # another control machine (its own journal) restarts the fleet: the drained host is skipped
        rc, restart = fleet_cli("restart", inventory, "--health-timeout", "60", "--json", journal=j2)
        assert rc == 0, restart
        assert [s["host"] for s in restart["skipped"]] == [h1], restart
        assert restart["skipped"][0]["drained"]["reason"] == "swap the NVMe, ticket 4411"
        assert sorted(i["instance"] for i in restart["instances"]) == sorted(others), restart
        after = instance_state(lab, fleet)
        assert all(after[r]["pid"] != before[r]["pid"] for r in others)  # restarted
        assert all(after[r]["unit"] == "inactive/dead" for r in mine), after  # left alone

        # a deploy of it: skipped, and no failure
        rc, deployed = fleet_json("deploy", inventory, "--limit", h1, "--json", timeout=600)
        assert rc == 0, deployed
        assert [(h["host"], h["status"]) for h in deployed["hosts"]] == [(h1, "skipped")], deployed
        assert "drained by" in deployed["hosts"][0]["note"]

        rc, status = fleet_json("status", inventory, "--json", "--interval", "0.5")
        assert rc == 0, status  # drained is not a failure
        rows = {r["instance"]: r for r in status["instances"]}
        for r in mine:
            assert rows[r]["state"] == "drained" and rows[r]["drained"]["reason"] == "swap the NVMe, ticket 4411"
            assert rows[r]["balancer"]["view"] == "MAINT", rows[r]
        for r in others:
            assert rows[r]["state"] == "ready" and rows[r]["balancer"]["view"] == "UP", rows[r]
            assert rows[r]["drained"] is None

        with Load(url, workers=4) as load:
            time.sleep(1)
            rc, back = fleet_cli("undrain", inventory, h1, "--health-timeout", "60", "--json", journal=j1)
            time.sleep(1)
        assert rc == 0, back
        drained = False
        assert load.failed == [] and load.ok > 0, load.failed[:10]
        assert on_host(lab, 1, "sudo test -e /var/lib/fleet/drained.json")[0] == 1  # the marker is gone
        final = instance_state(lab, fleet)
        assert all(final[r]["unit"] == "active/running" and final[r]["serves"] == (MODEL,) for r in mine), final
        assert {v["view"] for v in lb_views(inventory).values()} == {"UP"}
        steps = [(s["instance"], s["action"]) for s in history(back["id"], j1)["steps"]]
        for r in mine:
            assert [a for i, a in steps if i == r] == ["start", "lb:ready"], steps
        assert steps[-1] == (h1, "marker:removed"), steps
    finally:
        if drained:  # leave the lab serving for the tests after this one
            must(lab, 1, f"sudo rm -f /var/lib/fleet/drained.json; sudo systemctl enable --now {' '.join(units)}")
        balancer.stop(lab.dir)


def test_deploy_reconfigures_the_balancer_a_removed_host_leaves_traffic_first_an_added_one_joins_after_its_checks(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """``fleet deploy`` installs fleet's configuration on the lab's HAProxy (``on: local``) and
    reloads it keeping runtime state. Under load: an inventory without the second host takes that
    host's servers out of traffic before the reloaded configuration drops them (no request fails,
    the first host's servers stay UP); the whole inventory again brings them back, written disabled
    and set ready only once their instances pass the deploy's checks."""
    from fleet.lb.traffic import Balancer
    from fleet.lb.transport import LocalSocket
    from fleetlab import balancer

    lab, fleet = serving
    h0, h1 = fleet.hosts
    entry = balancer.balancer_entry(lab.dir, lab.state)
    hosts = [(n, {**d, "balancer": entry}) for n, d in runpy_hosts(fleet.inventory)]
    full, one = tmp_path / "full.py", tmp_path / "one.py"
    full.write_text(f"lab = {hosts!r}\n")
    one.write_text(f"lab = {[h for h in hosts if h[0] == h0]!r}\n")
    url = balancer.ensure(lab.dir, full)
    refs = [str(r) for r in fleet.instances]
    spec = load_fleet(str(full)).traffic().balancers[0].spec
    haproxy = Balancer(spec, LocalSocket(entry["admin_socket"], 5.0))

    def servers() -> dict[str, str]:
        return {st.server: st.admin.value for st in haproxy.servers_state()}

    try:
        rc, out = fleet_json("lb", "ready", str(full), *refs, "--json")
        assert rc == 0, out
        assert wait_until(lambda: {v["view"] for v in lb_views(str(full)).values()} == {"UP"}, 30)
        with Load(url, workers=4) as load:
            time.sleep(2)
            rc, gone = fleet_json("deploy", str(one), "--json", timeout=600)
            time.sleep(1)
        assert rc == 0, gone
        assert load.failed == [] and load.ok > 0, load.failed[:10]
        row = next(h for h in gone["hosts"] if h["host"] == "local")
        assert row["status"] == "changed", row
        assert any(op.startswith("out of traffic, then dropped:") and f"{h1}:vllm-0" in op and f"{h1}:vllm-1" in op
                   for op in row["operations"]), row  # fmt: skip
        assert servers() == {f"{h0}:vllm-0": "ready", f"{h0}:vllm-1": "ready"}  # kept across the reload

        rc, back = fleet_json("deploy", str(full), "--json", timeout=600)
        assert rc == 0, back
        row = next(h for h in back["hosts"] if h["host"] == "local")
        assert any(
            op.startswith("new servers, out of traffic until their instance serves:") for op in row["operations"]
        )
        joined = next(h for h in back["hosts"] if h["host"] == h1)["operations"]
        assert [op.split(":")[0] for op in joined if "into traffic" in op] == ["vllm-0", "vllm-1"], joined
        assert set(servers().values()) == {"ready"} and len(servers()) == 4
        assert wait_until(lambda: {v["view"] for v in lb_views(str(full)).values()} == {"UP"}, 30), lb_views(str(full))
        rc, again = fleet_json("deploy", str(full), "--json", timeout=600)
        assert rc == 0, again
        assert next(h for h in again["hosts"] if h["host"] == "local")["status"] == "unchanged", again
    finally:
        haproxy.close()
        balancer.stop(lab.dir)


def test_a_reboot_for_a_driver_change_takes_the_host_out_of_traffic_first_and_back_after_its_checks(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Behind the lab's HAProxy, under load: another driver for the second host (the lab's apt
    repository has two) needs a reboot; ``fleet deploy --reboot`` takes that host's instances out
    of traffic and waits for their sessions before the reboot, and puts them back ``ready`` only
    once they serve again. No request fails. (The host keeps that driver afterwards.)"""
    from fleetlab import balancer

    lab, fleet = serving
    h1 = fleet.hosts[1]
    entry = balancer.balancer_entry(lab.dir, lab.state)
    hosts = [(n, {**d, "balancer": entry, **({"nvidia_driver_version": "580.82.07"} if n == h1 else {})})
             for n, d in runpy_hosts(fleet.inventory)]  # fmt: skip
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"lab = {hosts!r}\n")
    url = balancer.ensure(lab.dir, inventory)
    refs = [str(r) for r in fleet.instances]
    try:
        rc, out = fleet_json("lb", "ready", str(inventory), *refs, "--json")
        assert rc == 0, out
        assert wait_until(lambda: {v["view"] for v in lb_views(str(inventory)).values()} == {"UP"}, 30)
        with Load(url, workers=4) as load:
            time.sleep(2)
            rc, result = fleet_json("deploy", str(inventory), "--limit", h1, "--reboot", "--json", timeout=900)
            time.sleep(1)
        assert rc == 0, result
        assert load.failed == [] and load.ok > 0, load.failed[:10]
        row = next(h for h in result["hosts"] if h["host"] == h1)
        ops = row["operations"]
        out_at = next(i for i, op in enumerate(ops) if op.startswith("out of traffic on haproxy on this machine"))
        reboot_at = next(i for i, op in enumerate(ops) if op.startswith("reboot ("))
        back_at = ops.index("back into traffic")
        assert out_at < reboot_at < back_at, ops
        assert row["reboot_required"] is None and all(e["healthy"] for e in row["endpoints"]), row
        assert must(lab, 1, "dpkg-query -W -f '${Version}' nvidia-kernel-open-dkms").startswith("580.82.07")
        assert wait_until(lambda: {v["view"] for v in lb_views(str(inventory)).values()} == {"UP"}, 30)
    finally:
        balancer.stop(lab.dir)


def fleet_json(*args: str, timeout: float = 120) -> tuple[int, Any]:
    proc = subprocess.run(
        [str(FLEET), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def runpy_hosts(inventory: str) -> list[tuple[str, dict[str, Any]]]:
    import runpy

    hosts: list[tuple[str, dict[str, Any]]] = runpy.run_path(inventory)["lab"]
    return hosts


def wait_until(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def power_cut(lab: LabFleet, index: int) -> None:
    """Pull the plug on a lab host: SIGKILL its init (PID 1 of the host's PID namespace); the
    kernel then kills every process of the host at once (sshd and vLLM with them), as a power
    loss does. Nothing is shut down cleanly."""
    import signal as sig

    from fleetlab.lab import machine_for

    state = lab.state
    m = machine_for(lab.dir, state, state.hosts[index])
    nspawn = m.pid()
    assert nspawn is not None, "host not running"
    todo, inits = [nspawn], []
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == "1":
            inits.append(pid)
            continue
        todo += [int(c) for c in children]
    assert len(inits) == 1, inits
    os.kill(inits[0], sig.SIGKILL)


def _names_the_host_going_down(text: str, host: str) -> bool:
    """How a host losing power reads: SSH to it failed, or (in the second before the connection
    drops) its systemd was already gone, so ``systemctl`` could not reach it over D-Bus."""
    return f"host {host}: SSH failed" in text or (
        f"host {host}: systemctl " in text and "Transport endpoint is not connected" in text
    )


def test_a_host_that_loses_power_mid_rollout_halts_it_naming_the_host(
    serving: tuple[LabFleet, RolloutFleet], tmp_path: Path
) -> None:
    """Batch 2 (the second host's first instance) has been stopped when that host loses power.
    The rollout halts with a reason that names the host, its batch's instance is reported as not
    rolled back (the host is gone), no instance on the other host is left stopped, and the journal
    says what happened. Once the host is back, the same rollout finishes. (Runs last: it reboots.)"""
    lab, fleet = serving
    h0, h1 = fleet.hosts
    for i in range(len(fleet.hosts)):  # the deploys of earlier tests may have pruned it (releases_kept)
        if on_host(lab, i, f"test -e {ROOT}/releases/next/.fleet-release.json")[0] != 0:
            make_release(lab, i, "next")
    policy = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "timeouts": {"unit": 5, "health": 60},
              "host_deadline_s": 120, "progress_deadline_s": 300}  # fmt: skip
    inventory = inventory_with(fleet, tmp_path / "inventory.py", policy)
    before = instance_state(lab, fleet)
    journal = tmp_path / "j.sqlite"
    argv = [str(FLEET), "rollout", inventory, "--release", "next", "--json", "--journal", str(journal)]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cut = False
    try:
        rid = _wait_for_step(journal, "stop", 2, proc=proc)  # batch 2 began: its instance was stopped
        with Journal(journal) as j:
            second = [s.instance for s in j.steps(rid) if s.action == "stop"][1]
        assert second == f"{h1}/vllm-0", second
        power_cut(lab, 1)
        cut = True
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 1, out + err
        result = json.loads(out)
        assert result["status"] == "halted"
        reason = result["reason"]
        assert reason.startswith(f"batch 2 failed ({h1}/vllm-0: "), reason
        assert f"rollback failed on {h1}/vllm-0 (host unreachable" in reason, reason
        assert _names_the_host_going_down(reason, h1), reason  # the on-call sees which host and why
        phases = {i["instance"]: i["phase"] for i in result["instances"]}
        assert phases == {f"{h0}/vllm-0": "done", f"{h1}/vllm-0": "rollback_failed",
                          f"{h0}/vllm-1": "pending", f"{h1}/vllm-1": "pending"}  # fmt: skip
        assert any(line.startswith(f"{h1}/vllm-0 is not serving: host {h1} cannot be reached") and
                   f"Bring {h1} back" in line for line in result["next"]), result["next"]  # fmt: skip
        # the live host: the canary stays on the new release, its other instance was never stopped
        live = instance_state_of_host(lab, fleet, 0)
        assert live[f"{h0}/vllm-0"]["runs"] == "next" and live[f"{h0}/vllm-0"]["unit"] == "active/running"
        untouched = ("unit", "pid", "restarts", "runs", "serves")
        assert {k: live[f"{h0}/vllm-1"][k] for k in untouched} == {k: before[f"{h0}/vllm-1"][k] for k in untouched}
        assert all(v["serves"] == (MODEL,) for v in live.values()), live
        data = history(rid, journal)
        assert data["status"] == "halted" and h1 in data["reason"]
        ours = [(s["instance"], s["action"], s["outcome"]) for s in data["steps"] if s["instance"].startswith(h1)]
        assert ours[0] == (f"{h1}/vllm-0", "stop", "ok"), ours
        assert all(i != f"{h1}/vllm-1" for i, _a, _o in ours)  # never touched
        failed = [s for s in data["steps"] if s["outcome"] == "failed"]  # a step sent to the dead host, if any
        assert all(_names_the_host_going_down(s["outcome_detail"], h1) for s in failed), failed
        down = next(i for i in data["instances"] if i["instance"] == f"{h1}/vllm-0")
        assert down["phase"] == "rollback_failed", down
        assert _names_the_host_going_down(down["failure"], h1) and "host unreachable" in down["rollback_failure"], down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if cut:
            lab_ops.restart_host(lab.opts.name, lab.state.hosts[1].name, lab.opts.state_root)
    # back: its units start at boot on the release its link names (the flip happened before the cut);
    # the same rollout, run again, finishes and every instance serves the new release.
    rc, again = fleet_cli("rollout", inventory, "--release", "next", "--json", journal=journal, timeout=600)
    assert rc == 0, again
    final = instance_state(lab, fleet)
    for name, inst in final.items():
        assert inst["unit"] == "active/running" and inst["runs"] == "next" and inst["serves"] == (MODEL,), (name, inst)


def instance_state_of_host(lab: LabFleet, fleet: RolloutFleet, index: int) -> dict[str, dict[str, Any]]:
    """``instance_state`` for one host (the others may be down)."""
    host = fleet.hosts[index]
    one = RolloutFleet(
        fleet.name, fleet.inventory, (host,), {host: fleet.ssh[host]},
        {r: s for r, s in fleet.instances.items() if r.host == host}, fleet.host_data, fleet.api_keys,
    )  # fmt: skip
    return instance_state(lab, one, first_index=index)

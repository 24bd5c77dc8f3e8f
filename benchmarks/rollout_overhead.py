"""What the rolling engine adds on top of vLLM's own restart time, and how fast a failed gate is seen.

    .venv/bin/python benchmarks/rollout_overhead.py [--instances 4] [--load 2.0]

Runs real vLLM stand-in processes on this machine (the stand-in's wheel in a fresh venv, the
simulated NVML library), one per simulated GPU, the way ``tests/lab/test_rollout_local.py`` does
(its executor is reused), and prints, side by side:

* **by hand**: what an operator's script would do, instance by instance: SIGTERM, wait for the
  exit, start, poll ``/health`` every 50 ms until 200. This is the lower bound (the stand-in's
  own stop and load time);
* **fleet**: the engine (journal, drain check on ``/metrics``, NVML check that the GPUs are free,
  the gates including a real completion, soak 0) rolling the same instances to a new release.

The difference divided by the instances is the per-instance overhead (target ≤ 1 s). Then the
time from a failure being observable to the engine's FAIL verdict: an engine that fails to load
(the unit fails: fatal at the next probe) and one alive but hung (the completion gate: its
timeout plus at most one probe).

Measured on the 2-core development machine (4 instances, load 2 s): by hand 12.29 s (3.07 s per
instance), fleet 13.84 s (3.46 s): +0.39 s per instance. Fails to load: FAIL 27 ms after the
process exited (probe interval 50 ms). Hung: FAIL 1.50 s after the first unanswered completion
with ``timeouts.completion`` = 1 s and a 0.25 s probe timeout (+0.50 s beyond the timeout).

``--lab N`` does the same on N lab hosts (two instances each) that ``fleet deploy`` got serving:
by hand is ``systemctl restart`` over SSH then polling ``/health``; fleet is ``SshExecutor``
(systemd, NVML and the release link over SSH, the gates over HTTP). Measured on the same machine
with ``--lab 4`` (8 instances, load 2 s): by hand 24.60 s (3.07 s each), fleet 31.01 s (3.88 s
each): +0.80 s per instance. A canary whose engine fails to load: the rollback's first step is
journaled 63 ms after systemd logged the engine's exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.rollout.batches import InstanceRef  # noqa: E402
from fleet.rollout.engine import Target, new_rollout  # noqa: E402
from fleet.rollout.gates import Expect, Status, start_track, step  # noqa: E402
from fleet.rollout.journal import Journal  # noqa: E402
from fleet.rollout.policy import GateTimeouts, RolloutPolicy  # noqa: E402
from fleet.rollout.probe import InstanceProber  # noqa: E402
from fleet.rollout.runner import Runner  # noqa: E402
from fleetlab.index import build_standin_wheel, fetch_wheels  # noqa: E402
from fleetlab.nvml import build_shim  # noqa: E402
from fleetlab.profiles import load_profile  # noqa: E402
from tests.lab import test_vllm_standin_local as standin  # noqa: E402
from tests.lab.test_rollout_local import SERVED, ProcessExecutor  # noqa: E402

POLICY = RolloutPolicy(
    batches=(1,),
    max_unavailable=1,
    soak_s=0.0,
    probe_interval_s=0.05,
    probe_timeout_s=2.0,
    drain_timeout_s=5,
    gpu_free_timeout_s=5,
    host_deadline_s=120,
    progress_deadline_s=300,
    timeouts=GateTimeouts(unit=10, health=60, models=10, completion=1.0, metrics=10),
)


def setup(root: Path) -> Any:
    shim = build_shim(root / "shim").parent
    wheels = root / "wheels"
    build_standin_wheel(wheels)
    fetch_wheels(wheels)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(wheels), "vllm==0.33.0"]
    subprocess.run(pip, check=True, env={**os.environ, "PIPCONFIG_FILE": os.devnull, "PIP_CONFIG_FILE": os.devnull})
    hf = root / "hf"
    config = REPO / "fleet" / "data" / "models" / standin.LLAMA_8B / "config.json"
    standin._install_model(hf, standin.LLAMA_8B, json.loads(config.read_text()))
    profile = root / "h100-sxm-8.profile"
    profile.write_text(load_profile("h100-sxm-8").render())
    return standin.Lab(root, venv, shim, hf, {"h100-sxm-8": profile})


class Starter:
    """Starts ``vllm serve`` like the tests' ``run`` fixture; kills everything at the end."""

    def __init__(self, lab: Any, root: Path, load_s: float) -> None:
        self.lab, self.root, self.load_s = lab, root, load_s
        self.started: list[Any] = []
        self.faults = root / "faults.json"

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> Any:
        port = standin.free_port()
        log_path = self.root / f"serve-{len(self.started)}.log"
        full_env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.lab.shim_dir),
            "FLEET_NVML_PROFILE": str(self.lab.profiles["h100-sxm-8"]),
            "FLEET_NVML_STATE_DIR": str(self.root / "nvml-state"),
            "HF_HOME": str(self.lab.hf_home),
            "FLEET_LAB_FAULTS": str(self.faults),
            "FLEET_LAB_LOAD_SECONDS": str(self.load_s),
            "FLEET_LAB_WATCHDOG_SECONDS": "0.5",
            **(env or {}),
        }
        full_env.pop("VLLM_API_KEY", None)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(self.lab.vllm), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            )  # fmt: skip
        server = standin.Server(proc, port, log_path, self.root / "nvml-state")
        self.started.append(server)
        return server

    def close(self) -> None:
        for server in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(5)


def by_hand(ex: ProcessExecutor) -> float:
    t0 = time.monotonic()
    for ref in ex.refs:
        server = ex.server[ref]
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        ex.start_unit(ref)
        deadline = time.monotonic() + 60
        while standin.health(ex.server[ref]) != 200:
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)
    return time.monotonic() - t0


def with_fleet(ex: ProcessExecutor, root: Path, release: str) -> float:
    journal = Journal(root / f"journal-{release}.sqlite")
    state = new_rollout(f"bench-{release}", "bench", "rollout", [Target(r, release, SERVED[release]) for r in ex.refs],
                        POLICY, time.time())  # fmt: skip
    journal.begin(state)
    t0 = time.monotonic()
    final = Runner(ex, journal).run(state)
    elapsed = time.monotonic() - t0
    assert final.status.value == "done", final.reason
    return elapsed


def detect_fail_load(lab: Any, starter: Starter) -> float:
    starter.faults.write_text(json.dumps({"fail_load": ["llama-bad"]}))
    server = starter(standin.LLAMA_8B, "--served-model-name", "llama-bad", "--max-model-len", "4096",
                     env={"CUDA_VISIBLE_DEVICES": "7"})  # fmt: skip
    exited: list[float] = []
    threading.Thread(target=lambda: (server.proc.wait(), exited.append(time.monotonic())), daemon=True).start()
    prober = InstanceProber(server.url, POLICY.probe_timeout_s)
    track = start_track(time.monotonic())
    while True:
        unit = standin_unit(server)
        now = time.monotonic()
        track, verdict = step(track, prober.probe("llama-bad", POLICY, unit, now), Expect("llama-bad"), POLICY, now)
        if verdict.status is Status.FAIL:
            starter.faults.write_text("{}")
            while not exited:
                time.sleep(0.001)
            return time.monotonic() - exited[0]
        time.sleep(POLICY.probe_interval_s)


def detect_hang(lab: Any, starter: Starter) -> tuple[float, float]:
    starter.faults.write_text(json.dumps({"hang_after_load": True}))
    server = starter(standin.LLAMA_8B, "--served-model-name", "llama-hung", "--max-model-len", "4096",
                     env={"CUDA_VISIBLE_DEVICES": "6"})  # fmt: skip
    server.wait_ready()
    prober = InstanceProber(server.url, 0.25)  # a completion of 4 tokens takes ~20 ms here
    policy = replace(POLICY, probe_timeout_s=0.25)
    track = start_track(time.monotonic())
    first_bad: float | None = None
    while True:
        now = time.monotonic()
        probe = prober.probe("llama-hung", policy, standin_unit(server), now)
        if first_bad is None and probe.completion is not None and probe.completion.status is None:
            first_bad = now
        track, verdict = step(track, probe, Expect("llama-hung"), policy, now)
        if verdict.status is Status.FAIL:
            starter.faults.write_text("{}")
            assert first_bad is not None
            return time.monotonic() - first_bad, policy.timeouts.completion
        time.sleep(policy.probe_interval_s)


def standin_unit(server: Any) -> Any:
    from fleet.rollout.gates import UnitState

    code = server.proc.poll()
    if code is None:
        return UnitState("active", "running", 0, server.proc.pid)
    return UnitState("failed", "failed") if code else UnitState("inactive", "dead")


# ---- on lab hosts (``--lab``): systemd units over SSH, deployed by ``fleet deploy`` ---------------


def lab_by_hand(lab: Any, fleet: Any) -> float:
    """What an operator's loop does: ``systemctl restart`` over SSH, poll ``/health`` every 50 ms."""
    from tests.lab.test_rollout_lab import must

    t0 = time.monotonic()
    for ref, spec in fleet.instances.items():
        must(lab, fleet.hosts.index(ref.host), f"sudo systemctl restart {spec.unit}")
        prober = InstanceProber(spec.url, 2)
        while prober.health().status != 200:
            time.sleep(0.05)
    return time.monotonic() - t0


def lab_fleet_restart(fleet: Any, journal: Path) -> tuple[float, Any]:
    from fleet.rollout.runner import open_rollout
    from fleet.rollout.ssh_executor import SshExecutor

    ex: SshExecutor = fleet.executor()
    try:
        t0 = time.monotonic()
        releases = {h: ex.links(h)[0] for h in fleet.hosts}
        state = new_rollout("bench-restart", fleet.name, "restart", fleet.targets(releases, restart=True),
                            replace(POLICY, batches=(1,)), time.time())  # fmt: skip
        with Journal(journal) as j:
            final = Runner(ex, j).run(open_rollout(j, state))
            j.release(fleet.name, state.id)
        return time.monotonic() - t0, final
    finally:
        ex.close()


def lab_detect_fail_load(lab: Any, fleet: Any, journal: Path) -> float:
    """Roll the canary onto the release that fails to load; the time from the engine process's
    exit (systemd's ExecMainExitTimestampMonotonic: the host shares this machine's kernel clock) to
    the engine's verdict (the rollback's first step, journaled the same tick)."""
    from fleet.rollout.runner import open_rollout

    ex = fleet.executor()
    canary = next(iter(fleet.instances))
    seen: list[float] = []

    def event(line: str) -> None:
        if line.startswith(f"stop {canary}") and not seen and started:
            seen.append(time.monotonic())
        if line.startswith(f"start {canary}"):
            started.append(True)

    started: list[bool] = []
    try:
        targets = [t for t in fleet.targets(dict.fromkeys(fleet.hosts, "bad"), restart=False) if t.ref == canary]
        state = new_rollout("bench-fail", fleet.name, "rollout", targets, replace(POLICY, batches=(1,)), time.time())
        with Journal(journal) as j:
            final = Runner(ex, j, on_event=event).run(open_rollout(j, state))
            j.release(fleet.name, state.id)
    finally:
        ex.close()
    assert final.status.value == "halted", final.reason
    from tests.lab.test_rollout_lab import must

    spec = fleet.instances[canary]
    text = must(lab, 0, f"sudo journalctl -o json -u {spec.unit} MESSAGE_ID=98e322203f7a4ed290d09fe03c09fe15 -n 50")
    exits = [int(json.loads(line)["__MONOTONIC_TIMESTAMP"]) / 1e6 for line in text.splitlines() if line.strip()]
    assert seen and exits, (seen, text[-500:])
    exit_at = max(e for e in exits if e <= seen[0])
    return seen[0] - exit_at


def lab_main(hosts: int) -> None:
    from fleetlab import lab as lab_ops
    from tests.lab.conftest import free_octet
    from tests.lab.test_rollout_lab import bring_up_serving

    with tempfile.TemporaryDirectory(prefix="fleet-bench-rollout-lab-") as tmp:
        root = Path(tmp)
        name = f"brl{os.getpid()}"
        try:
            t0 = time.monotonic()
            lab, fleet = bring_up_serving(root, name, free_octet(os.getpid() + 41), hosts)
            print(f"{hosts} lab hosts, {len(fleet.instances)} instances serving in {time.monotonic() - t0:.0f} s")
            hand = lab_by_hand(lab, fleet)
            took, final = lab_fleet_restart(fleet, root / "journal.sqlite")
            assert final.status.value == "done", final.reason
            n = len(fleet.instances)
            print(f"rolling restart of {n} instances on {hosts} lab hosts (stand-in load 2 s, soak 0):")
            print(f"  by hand (systemctl restart over SSH, poll /health)  {hand:6.2f} s  ({hand / n:.2f} s each)")
            print(f"  fleet restart (journal, drain, NVML over SSH, gates)  {took:6.2f} s  ({took / n:.2f} s each)")
            print(f"  overhead per instance: {(took - hand) / n:+.2f} s (target <= 1 s)")
            fail = lab_detect_fail_load(lab, fleet, root / "journal.sqlite")
            print(f"canary fails to load: verdict {fail * 1000:.0f} ms after the engine exited (target <= 1 s)")
        finally:
            lab_ops.down(name, root / "state")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--load", type=float, default=2.0, help="the stand-in's load time in seconds")
    parser.add_argument("--lab", type=int, metavar="HOSTS", help="on this many lab hosts (2 instances each) instead")
    args = parser.parse_args()
    if args.lab:
        lab_main(args.lab)
        return
    with tempfile.TemporaryDirectory(prefix="fleet-bench-rollout-") as tmp:
        root = Path(tmp)
        lab = setup(root)
        starter = Starter(lab, root, args.load)
        try:
            refs = [InstanceRef(f"h{i}", "vllm-0") for i in range(args.instances)]
            ex = ProcessExecutor(lab, starter, root / "nvml-state", refs)
            for ref in refs:
                ex.start_unit(ref)
            for ref in refs:
                ex.server[ref].wait_ready(60)
            hand = by_hand(ex)
            fleet = with_fleet(ex, root, "v2")
            n = args.instances
            print(f"rolling restart of {n} instances (stand-in load {args.load:g} s each, soak 0):")
            print(f"  by hand (SIGTERM, start, poll /health)  {hand:6.2f} s  ({hand / n:.2f} s each)")
            print(f"  fleet rollout (journal, drain, NVML, gates)  {fleet:6.2f} s  ({fleet / n:.2f} s per instance)")
            print(f"  overhead per instance: {(fleet - hand) / n:+.2f} s (target <= 1 s)")
            fail = detect_fail_load(lab, starter)
            print(f"engine fails to load: FAIL verdict {fail * 1000:.0f} ms after the process exited (target <= 1 s)")
            hang, timeout = detect_hang(lab, starter)
            print(f"alive but hung: FAIL {hang:.2f} s after the first unanswered completion "
                  f"(timeouts.completion = {timeout:g} s; detection beyond it {hang - timeout:+.2f} s)")  # fmt: skip
        finally:
            starter.close()


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/rollout_overhead.py"):
        main()

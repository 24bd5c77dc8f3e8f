"""The whole engine (runner, journal, gates, HTTP probes, NVML) rolling real vLLM stand-in processes.

Each "instance" is a real ``vllm serve`` process of the stand-in on its own simulated GPU; a
release is the served model name it starts with. The executor here plays systemd and the release
link for local processes (start = spawn, stop = SIGTERM and wait, as ``systemctl stop``); the GPU
processes come from the real NVML shim through unmodified pynvml, the gates from real HTTP. The
SSH executor for lab hosts comes with ``fleet deploy``; this is the engine on real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import Phase, RolloutStatus, Target, new_rollout
from fleet.rollout.executor import ExecutorError
from fleet.rollout.gates import Probe, UnitState
from fleet.rollout.journal import Journal
from fleet.rollout.observe import GpuProcess, InstanceFacts
from fleet.rollout.policy import GateTimeouts, HookPlace, Hooks, RolloutPolicy
from fleet.rollout.probe import InstanceProber
from fleet.rollout.runner import Runner
from tests.lab import test_vllm_standin_local as standin
from tests.lab.polling import wait_for

pytestmark = standin.pytestmark
lab = standin.lab
run = standin.run

SERVED = {"v1": "llama-v1", "v2": "llama-v2", "bad": "llama-bad"}
REFS = [InstanceRef("h0", "vllm-0"), InstanceRef("h1", "vllm-0")]


class ProcessExecutor:
    """``Executor`` over local stand-in processes (systemd's part played by this class)."""

    def __init__(self, lab: Any, run: Callable[..., Any], state_dir: Path, refs: Sequence[InstanceRef] = REFS) -> None:
        self.lab, self.run, self.state_dir = lab, run, state_dir
        self.refs = list(refs)
        self.gpu = {ref: i for i, ref in enumerate(self.refs)}  # one simulated GPU each
        self.server: dict[InstanceRef, Any] = {}
        self.release: dict[InstanceRef, str] = dict.fromkeys(self.refs, "v1")
        self.pids: dict[InstanceRef, set[int]] = {r: set() for r in self.refs}
        self.sigkill_on_stop: set[InstanceRef] = set()  # a unit whose stop leaves the engine behind
        self.log: list[str] = []

    def _unit(self, ref: InstanceRef) -> UnitState:
        server = self.server.get(ref)
        if server is None:
            return UnitState("inactive", "dead")
        self.pids[ref].update([server.proc.pid, *server.workers()])
        code = server.proc.poll()
        if code is None:
            return UnitState("active", "running", 0, server.proc.pid)
        return UnitState("failed", "failed") if code else UnitState("inactive", "dead")

    def _prober(self, ref: InstanceRef) -> InstanceProber:
        return InstanceProber(self.server[ref].url, timeout_s=2)

    def facts(self, ref: InstanceRef) -> InstanceFacts:
        unit = self._unit(ref)
        running = unit.active_state == "active"
        gpus: tuple[GpuProcess, ...] = ()
        if not running:
            gpu = self.gpu[ref]
            seen = standin.nvml(self.lab, SimpleNamespace(state_dir=self.state_dir))[gpu]["procs"]
            gpus = tuple(GpuProcess(pid, _comm(pid), gpu, used, pid in self.pids[ref]) for pid, used in seen.items())
        prober = self._prober(ref) if ref in self.server else None
        return InstanceFacts(
            ref,
            unit=unit,
            release=self.release[ref],
            model=SERVED[self.release[ref]],
            gpu_processes=gpus,
            in_flight=prober.in_flight() if prober and running else None,
            serving=bool(prober and running and prober.health().status == 200),
        )

    def probe(self, ref: InstanceRef, policy: RolloutPolicy, model: str) -> Probe:
        return self._prober(ref).probe(model, policy, self._unit(ref))

    def stop_unit(self, ref: InstanceRef) -> None:
        self.log.append(f"stop {ref}")
        server = self.server.get(ref)
        if server is None or server.proc.poll() is not None:
            return
        server.proc.send_signal(signal.SIGKILL if ref in self.sigkill_on_stop else signal.SIGTERM)
        server.proc.wait(30)

    def start_unit(self, ref: InstanceRef) -> None:
        self.log.append(f"start {ref} {self.release[ref]}")
        served = SERVED[self.release[ref]]
        self.server[ref] = self.run(
            standin.LLAMA_8B, "--served-model-name", served, "--max-model-len", "4096",
            env={"CUDA_VISIBLE_DEVICES": str(self.gpu[ref])},
        )  # fmt: skip

    def kill(self, ref: InstanceRef, pids: Sequence[int]) -> None:
        self.log.append(f"kill {ref} {sorted(pids)}")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        if not wait_for(lambda: not any(standin.alive(p) for p in pids), timeout=10):
            raise ExecutorError(f"{ref}: pids {list(pids)} survived SIGKILL")

    def flip_release(self, ref: InstanceRef, release: str, revision: str | None = None) -> None:
        self.log.append(f"flip {ref} {release}")
        self.release[ref] = release

    def run_hook(self, ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        # every "host" of this executor is this machine: a hook runs here wherever ``on`` says
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
        if out.returncode:
            raise ExecutorError(f"hook {argv[0]} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


POLICY = RolloutPolicy(
    batches=(1, -1),
    max_unavailable=1,
    soak_s=1.0,
    probe_interval_s=0.1,
    probe_timeout_s=2.0,
    drain_timeout_s=5,
    gpu_free_timeout_s=5,
    host_deadline_s=120,
    progress_deadline_s=300,
    timeouts=GateTimeouts(unit=10, health=30, models=10, completion=10, metrics=10),
)


@pytest.fixture
def fleet(lab: Any, run: Callable[..., Any], tmp_path: Path) -> ProcessExecutor:
    ex = ProcessExecutor(lab, run, tmp_path / "nvml-state")
    for ref in REFS:
        ex.start_unit(ref)
    for ref in REFS:
        ex.server[ref].wait_ready()
    ex.log.clear()
    return ex


def rollout(tmp_path: Path, ex: ProcessExecutor, release: str, policy: RolloutPolicy = POLICY) -> Any:
    journal = Journal(tmp_path / "journal.sqlite")
    state = new_rollout("local-1", "local", "rollout", [Target(r, release, SERVED[release]) for r in REFS], policy, 0)
    journal.acquire("local", state.id)
    journal.begin(state)
    final = Runner(ex, journal).run(state)
    journal.release("local", state.id)
    return final, journal


def serving(ex: ProcessExecutor, ref: InstanceRef) -> tuple[str, ...]:
    models = ex._prober(ref).models()
    return models.ids if models.status == 200 else ()


def test_clean_rollout_with_hooks(tmp_path: Path, fleet: ProcessExecutor) -> None:
    hook_log = tmp_path / "hooks.log"
    append = [sys.executable, "-c", "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')", str(hook_log)]
    hooks = Hooks(drain=(*append, "drain {host}/{instance}:{port}"), undrain=(*append, "undrain {host}/{instance}"))
    state, journal = rollout(tmp_path, fleet, "v2", RolloutPolicy(**{**POLICY.__dict__, "hooks": hooks}))
    assert state.status is RolloutStatus.DONE, state.reason
    assert [serving(fleet, r) for r in REFS] == [("llama-v2",), ("llama-v2",)]
    assert hook_log.read_text().splitlines() == [
        "drain h0/vllm-0:8000", "undrain h0/vllm-0", "drain h1/vllm-0:8000", "undrain h1/vllm-0",
    ]  # fmt: skip
    assert fleet.log == ["stop h0/vllm-0", "flip h0/vllm-0 v2", "start h0/vllm-0 v2",
                         "stop h1/vllm-0", "flip h1/vllm-0 v2", "start h1/vllm-0 v2"]  # fmt: skip
    assert journal.history("local")[0].status == "done"


def test_canary_fails_to_load_rolled_back_other_untouched(tmp_path: Path, fleet: ProcessExecutor) -> None:
    (tmp_path / "faults.json").write_text('{"fail_load": ["llama-bad"]}')
    other_pid = fleet.server[REFS[1]].proc.pid
    state, _ = rollout(tmp_path, fleet, "bad")
    assert state.status is RolloutStatus.HALTED
    assert state.reason.startswith("batch 1 failed (h0/vllm-0: unit gate: unit failed (failed/failed))")
    assert state.inst(REFS[0]).phase is Phase.ROLLED_BACK
    assert [serving(fleet, r) for r in REFS] == [("llama-v1",), ("llama-v1",)]
    assert fleet.server[REFS[1]].proc.pid == other_pid  # never touched
    assert not any("h1" in line for line in fleet.log)


def test_orphaned_engine_found_through_nvml_and_stopped(tmp_path: Path, fleet: ProcessExecutor) -> None:
    fleet.sigkill_on_stop.add(REFS[0])  # the API server dies; its worker keeps the GPU (vllm#55510)
    worker = fleet.server[REFS[0]].workers()
    state, journal = rollout(tmp_path, fleet, "v2")
    assert state.status is RolloutStatus.DONE, state.reason
    kill = next(s for s in journal.steps("local-1") if s.action == "kill")
    assert kill.instance == "h0/vllm-0"
    # With TP 1 vLLM runs the model inside VLLM::EngineCore (the uni executor), so the engine core
    # holds the GPU; comm is cut at 15 characters by the kernel, as ps shows it.
    assert f"pid {worker[0]} (VLLM::EngineCor) holding" in kill.detail and "on GPU 0" in kill.detail
    assert f"kill h0/vllm-0 {worker}" in fleet.log
    assert [serving(fleet, r) for r in REFS] == [("llama-v2",), ("llama-v2",)]

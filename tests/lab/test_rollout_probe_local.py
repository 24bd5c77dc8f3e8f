"""The rollout's HTTP probes and gate verdicts against the real vLLM stand-in, run on this machine.

The stand-in is built, installed into a venv and started with the simulated NVML exactly as in
``test_vllm_standin_local`` (its fixtures are reused, not copied). Each test starts real
``vllm serve`` processes and judges them through ``InstanceProber`` and ``fleet.rollout.gates``:
healthy (with an API key read from a secret reference), still loading, fails to load, alive but
hung after load, and draining after SIGTERM.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleet.inventory.spec import SecretRef
from fleet.rollout.gates import (
    Check,
    Expect,
    HttpAnswer,
    ModelsAnswer,
    Probe,
    Status,
    UnitState,
    evaluate,
    start_track,
    step,
)
from fleet.rollout.policy import GateTimeouts, MetricThreshold, RolloutPolicy
from fleet.rollout.probe import InstanceProber
from fleet.secret_store import SecretError, read_secret
from tests.lab import test_vllm_standin_local as standin
from tests.lab.polling import wait_for

pytestmark = standin.pytestmark

# The stand-in's fixtures, shared: one built wheel and venv per module, servers killed at teardown.
lab = standin.lab
run = standin.run
Server = standin.Server
LLAMA_8B = standin.LLAMA_8B

KEY = "rollout-probe-key-0123"
POLICY = RolloutPolicy(soak_s=0.6, probe_interval_s=0.1, probe_timeout_s=2.0, timeouts=GateTimeouts(completion=3))


def key_file(tmp_path: Path) -> SecretRef:
    path = tmp_path / "api-key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return SecretRef("file", str(path))


def serve(run: Callable[..., Any], *extra: str, key: bool = False, env: dict[str, str] | None = None) -> Any:
    full_env = {**(env or {}), **({"VLLM_API_KEY": KEY} if key else {})}
    return run(LLAMA_8B, "--served-model-name", "llama-8b", "--max-model-len", "4096", *extra, env=full_env)


def unit_of(server: Any) -> UnitState:
    """What systemd would show for this process as a ``Type=simple`` unit (no systemd here)."""
    code = server.proc.poll()
    if code is None:
        return UnitState("active", "running", 0, server.proc.pid)
    return UnitState("failed", "failed") if code else UnitState("inactive", "dead")


def gates_until_verdict(
    server: Any, prober: InstanceProber, policy: RolloutPolicy, timeout: float = 30
) -> tuple[str, int]:
    """Probe with the real clock until the gates say pass or fail; the verdict and the probe count."""
    track = start_track(time.monotonic())
    deadline = time.monotonic() + timeout
    probes = 0
    while time.monotonic() < deadline:
        now = time.monotonic()
        track, verdict = step(
            track,
            prober.probe("llama-8b", policy, unit_of(server), now),
            Expect("llama-8b", 0, policy.metrics),
            policy,
            now,
        )
        probes += 1
        if verdict.status is not Status.WAIT:
            return str(verdict), probes
        time.sleep(policy.probe_interval_s)
    raise AssertionError(f"no verdict in {timeout}s; last: {verdict}")


def test_healthy_instance_passes_every_gate_with_the_key_from_its_secret_ref(
    tmp_path: Path, run: Callable[..., Any]
) -> None:
    server = serve(run, key=True)
    api_key = read_secret(key_file(tmp_path))
    prober = InstanceProber(server.url, timeout_s=2, api_key=api_key)
    assert KEY not in repr(prober)
    policy = RolloutPolicy(
        soak_s=0.6,
        probe_interval_s=0.1,
        metrics=(
            MetricThreshold("vllm:num_requests_waiting", max=0),
            MetricThreshold("vllm:kv_cache_usage_perc", max=0.98),
        ),
    )
    verdict, probes = gates_until_verdict(server, prober, policy)
    assert verdict.startswith("pass soak: all gates green for"), verdict
    assert probes >= 3  # it loaded, then soaked
    probe = prober.probe("llama-8b", policy)
    assert probe.completion is not None and probe.completion.completion_tokens == 4
    assert probe.completion.finish_reason == "length" and probe.completion.text
    assert prober.in_flight() == 0
    assert KEY not in server.log()
    # Without the key, or with a wrong one, the models gate fails at once and says why.
    for wrong in (None, "wrong-key"):
        probe = InstanceProber(server.url, 2, wrong).probe("llama-8b", policy, unit_of(server))
        checks = evaluate(probe, Expect("llama-8b"))
        assert checks[-1][:2] == (checks[-1][0], Check.FATAL) and "API key was refused" in checks[-1][2]


def test_secret_refs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_TEST_KEY", KEY)
    assert read_secret(SecretRef("env", "FLEET_TEST_KEY")) == KEY
    monkeypatch.delenv("FLEET_TEST_KEY")
    with pytest.raises(SecretError, match="FLEET_TEST_KEY is not set"):
        read_secret(SecretRef("env", "FLEET_TEST_KEY"))
    ref = key_file(tmp_path)
    Path(ref.target).chmod(0o644)
    with pytest.raises(SecretError, match="readable by others \\(mode 644\\); chmod 600 it") as exc:
        read_secret(ref)
    assert KEY not in str(exc.value)


def test_loading_is_pending_not_failed(run: Callable[..., Any]) -> None:
    server = serve(run, env={"FLEET_LAB_LOAD_SECONDS": "3"})
    assert wait_for(lambda: bool(server.workers()), timeout=10)
    probe = InstanceProber(server.url, 2).probe("llama-8b", POLICY, unit_of(server))
    assert probe.health is not None and probe.health.error == "connection refused"
    assert probe.models is None and probe.completion is None  # nothing asked of a server that is not up
    assert evaluate(probe, Expect("llama-8b"))[-1][1] is Check.PENDING
    # Still loading when the health gate's timeout runs out: that fails, naming the timeout.
    verdict, _ = gates_until_verdict(server, InstanceProber(server.url, 1), replace_timeouts(health=1.0))
    assert verdict.startswith("fail health: /health: connection refused") and "timeouts.health=1s" in verdict


def test_fails_to_load_never_passes_health(tmp_path: Path, run: Callable[..., Any]) -> None:
    (tmp_path / "faults.json").write_text(json.dumps({"fail_load": [LLAMA_8B]}))
    server = serve(run)
    assert server.wait_exit() != 0
    prober = InstanceProber(server.url, 1)
    assert prober.health().error == "connection refused"
    assert prober.in_flight() is None  # no /metrics: "drained" then comes from the process being gone
    # The process exited non-zero, as systemd's failed unit: fatal at the first probe, no waiting.
    verdict, probes = gates_until_verdict(server, prober, POLICY)
    assert (verdict, probes) == ("fail unit: unit failed (failed/failed)", 1)


def test_hung_after_load_fails_the_completion_gate(tmp_path: Path, run: Callable[..., Any]) -> None:
    (tmp_path / "faults.json").write_text(json.dumps({"hang_after_load": True}))
    server = serve(run)
    server.wait_ready()
    prober = InstanceProber(server.url, timeout_s=0.5)
    assert prober.health().status == 200  # alive...
    t0 = time.monotonic()
    verdict, _ = gates_until_verdict(server, prober, replace_timeouts(completion=2.0))
    assert verdict.startswith("fail completion: completion: timed out after 0.5s (alive but not generating?)"), verdict
    assert "timeouts.completion=2s" in verdict
    print(f"\nhung engine: completion gate failed {time.monotonic() - t0:.2f}s after the first probe")
    assert (prober.in_flight() or 0) >= 1  # ...with requests stuck in the engine


def replace_timeouts(**changes: float) -> RolloutPolicy:
    return replace(POLICY, timeouts=replace(POLICY.timeouts, **changes))


def test_draining_is_judged_from_in_flight_requests_and_the_exit(run: Callable[..., Any]) -> None:
    server = serve(run, "--shutdown-timeout", "20", env={"FLEET_LAB_TOKEN_SECONDS": "0.02"})
    server.wait_ready()
    prober = InstanceProber(server.url, timeout_s=5)
    result: list[Any] = []
    slow = threading.Thread(target=lambda: result.append(prober.completion("llama-8b", "slow", 100)))
    slow.start()
    assert wait_for(lambda: prober.in_flight() == 1, timeout=10)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # Not drained while the request runs, whatever /health says; a new completion does not pass.
    assert prober.in_flight() == 1
    late = prober.completion("llama-8b", "late", 2)
    assert evaluate(_probe_with(prober, late), Expect("llama-8b"))[-1][1] in (Check.BAD, Check.PENDING), late
    slow.join(30)
    assert result and result[0].status == 200 and result[0].completion_tokens == 100
    assert server.wait_exit() == 0
    # Drained: the process is gone and /metrics no longer answers.
    assert prober.in_flight() is None and not standin.alive(server.proc.pid)


def _probe_with(prober: InstanceProber, completion: Any) -> Any:
    return Probe(
        time.monotonic(),
        unit=UnitState("active", "running"),
        health=HttpAnswer(200),
        models=ModelsAnswer(200, ids=("llama-8b",)),
        completion=completion,
    )


def test_metrics_are_parsed_with_prometheus_client(run: Callable[..., Any]) -> None:
    server = serve(run)
    server.wait_ready()
    prober = InstanceProber(server.url, 2)
    assert prober.completion("llama-8b", "count me", 3).completion_tokens == 3
    m = prober.metrics()
    assert m.value("vllm:generation_tokens_total") == 3
    assert m.value("vllm:request_success_total", {"finished_reason": "length"}) == 1
    assert m.value("vllm:num_requests_running", {"model_name": "llama-8b"}) == 0
    assert m.value("vllm:gpu_cache_usage_perc") is None

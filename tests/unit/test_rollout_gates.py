"""Gate verdicts: each gate's table, order, timeouts per gate, soak reset by any failure (fake clock)."""

from __future__ import annotations

import pytest

from fleet.rollout.gates import (
    Check,
    CompletionAnswer,
    Expect,
    Gate,
    GateTrack,
    GpuEvents,
    GpuEventSeen,
    HttpAnswer,
    MetricsAnswer,
    ModelsAnswer,
    Probe,
    Status,
    UnitState,
    check_completion,
    check_gpu_events,
    check_health,
    check_metrics,
    check_models,
    check_unit,
    evaluate,
    start_track,
    step,
)
from fleet.rollout.policy import GateTimeouts, MetricThreshold, RolloutPolicy

RUNNING = UnitState("active", "running", 0, 1234)
OK_HEALTH = HttpAnswer(200)
OK_MODELS = ModelsAnswer(200, ids=("llama-8b",))
OK_COMPLETION = CompletionAnswer(200, text=" OK", finish_reason="length", completion_tokens=4, elapsed_s=0.05)
EXPECT = Expect(model="llama-8b")


@pytest.mark.parametrize(
    ("unit", "baseline", "expected", "words"),
    [
        (RUNNING, 0, Check.PASS, "active/running"),
        (UnitState("activating", "start", 0), 0, Check.PENDING, "activating/start"),
        (UnitState("failed", "failed", 0), 0, Check.FATAL, "unit failed"),
        (UnitState("active", "running", 3), 2, Check.FATAL, "restarted 1 time(s)"),
        (UnitState("active", "running", 3), 3, Check.PASS, "active/running"),
        (UnitState("activating", "auto-restart", 0), 0, Check.FATAL, "restarting"),
        (UnitState("inactive", "dead", 0), 0, Check.FATAL, "stopped though fleet started it"),
        (None, 0, Check.PENDING, "not observed"),
    ],
)
def test_unit_gate(unit: UnitState | None, baseline: int, expected: Check, words: str) -> None:
    status, detail = check_unit(unit, baseline)
    assert status is expected and words in detail


@pytest.mark.parametrize(
    ("answer", "expected", "words"),
    [
        (HttpAnswer(200), Check.PASS, "200"),
        (HttpAnswer(None, "connection refused"), Check.PENDING, "connection refused (vLLM listens only once"),
        (HttpAnswer(None, "timed out after 10s"), Check.PENDING, "timed out"),
        (HttpAnswer(503), Check.FATAL, "engine is dead"),
        (HttpAnswer(500), Check.BAD, "HTTP 500"),
    ],
)
def test_health_gate(answer: HttpAnswer, expected: Check, words: str) -> None:
    status, detail = check_health(answer)
    assert status is expected and words in detail


@pytest.mark.parametrize(
    ("answer", "expected", "words"),
    [
        (OK_MODELS, Check.PASS, "lists 'llama-8b'"),
        (ModelsAnswer(200, ids=("mistral-7b",)), Check.FATAL, "lists ['mistral-7b'], not 'llama-8b'"),
        (ModelsAnswer(401), Check.FATAL, "API key was refused"),
        (ModelsAnswer(500), Check.BAD, "HTTP 500"),
        (ModelsAnswer(None, "connection reset"), Check.PENDING, "connection reset"),
    ],
)
def test_models_gate(answer: ModelsAnswer, expected: Check, words: str) -> None:
    status, detail = check_models(answer, "llama-8b")
    assert status is expected and words in detail


@pytest.mark.parametrize(
    ("answer", "expected", "words"),
    [
        (OK_COMPLETION, Check.PASS, "4 token(s)"),
        (CompletionAnswer(200, text="", finish_reason="abort", completion_tokens=0), Check.BAD, '"abort"'),
        (CompletionAnswer(200, text=" x", finish_reason="abort", completion_tokens=1), Check.BAD, '"abort"'),
        (CompletionAnswer(200, text="", finish_reason="length", completion_tokens=0), Check.BAD, "no tokens"),
        (CompletionAnswer(None, "timed out after 10s"), Check.BAD, "alive but not generating"),
        (CompletionAnswer(503), Check.BAD, "HTTP 503"),
        (
            CompletionAnswer(500, "cannot schedule new futures after shutdown"),
            Check.BAD,
            "HTTP 500: cannot schedule new futures after shutdown (the server is draining or stopping)",
        ),
        (CompletionAnswer(401), Check.FATAL, "API key"),
        (None, Check.PENDING, "not probed"),
    ],
)
def test_completion_gate(answer: CompletionAnswer | None, expected: Check, words: str) -> None:
    status, detail = check_completion(answer)
    assert status is expected and words in detail


METRICS = MetricsAnswer(
    200,
    samples=(
        ("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "llama-8b")), 3.0),
        ("vllm:num_requests_waiting", (("engine", "1"), ("model_name", "llama-8b")), 4.0),
        ("vllm:kv_cache_usage_perc", (("engine", "0"),), 0.5),
    ),
)


@pytest.mark.parametrize(
    ("thresholds", "expected", "words"),
    [
        ((), Check.PASS, "no metric thresholds"),
        ((MetricThreshold("vllm:num_requests_waiting", max=7),), Check.PASS, "1 metric threshold(s) hold"),
        ((MetricThreshold("vllm:num_requests_waiting", max=6),), Check.BAD, "<= 6 is violated: 7"),  # summed
        ((MetricThreshold("vllm:num_requests_waiting", max=3, labels=(("engine", "0"),)),), Check.PASS, "hold"),
        ((MetricThreshold("vllm:kv_cache_usage_perc", min=0.6),), Check.BAD, ">= 0.6 is violated: 0.5"),
        ((MetricThreshold("vllm:gpu_cache_usage_perc", max=1),), Check.BAD, "no data is not a pass"),
    ],
)
def test_metrics_gate(thresholds: tuple[MetricThreshold, ...], expected: Check, words: str) -> None:
    status, detail = check_metrics(METRICS, thresholds)
    assert status is expected and words in detail


def test_metrics_gate_without_an_answer() -> None:
    assert check_metrics(MetricsAnswer(None, "refused"), (MetricThreshold("x", max=1),))[0] is Check.BAD


def healthy(at: float, **changes: object) -> Probe:
    fields: dict[str, object] = {
        "unit": RUNNING,
        "health": OK_HEALTH,
        "models": OK_MODELS,
        "completion": OK_COMPLETION,
        "metrics": None,
    }
    fields.update(changes)
    return Probe(at, **fields)  # type: ignore[arg-type]


def test_gates_stop_at_the_first_that_does_not_pass() -> None:
    checks = evaluate(healthy(0, health=HttpAnswer(None, "connection refused"), models=None), EXPECT)
    assert [(g, c) for g, c, _ in checks] == [(Gate.UNIT, Check.PASS), (Gate.HEALTH, Check.PENDING)]
    assert (
        evaluate(Probe(0, unreachable="ssh: no route to host"), EXPECT)[0][2]
        == "host unreachable: ssh: no route to host"
    )


POLICY = RolloutPolicy(soak_s=10, timeouts=GateTimeouts(unit=5, health=60, models=5, completion=20, metrics=20))


def run(probes: list[Probe], policy: RolloutPolicy = POLICY, expect: Expect = EXPECT) -> list[tuple[GateTrack, str]]:
    track = start_track(0.0)
    out = []
    for probe in probes:
        track, verdict = step(track, probe, expect, policy, probe.at)
        out.append((track, str(verdict)))
    return out


def test_loading_then_healthy_then_soaked() -> None:
    refused = HttpAnswer(None, "connection refused")
    probes = [healthy(t, health=refused) for t in (1, 20, 40)] + [healthy(t) for t in (45, 50, 55)]
    verdicts = [v for _, v in run(probes)]
    assert verdicts[0].startswith("wait health: /health: connection refused")
    assert verdicts[2].endswith("39.0s of 60s")  # counted from t=1, when the unit gate first passed
    assert verdicts[3] == "wait soak: soaking: all gates green for 0.0s of 10s"
    assert verdicts[4] == "wait soak: soaking: all gates green for 5.0s of 10s"
    assert verdicts[5] == "pass soak: all gates green for 10.0s"


def test_never_loads_fails_at_the_health_timeout() -> None:
    refused = HttpAnswer(None, "connection refused")
    verdicts = [v for _, v in run([healthy(t, health=refused) for t in (1, 30, 62)])]
    assert verdicts[-1].startswith("fail health: /health: connection refused")
    assert verdicts[-1].endswith("still so after 61.0s (timeouts.health=60s)")


def test_fatal_fails_at_once() -> None:
    _, v = run([healthy(1, unit=UnitState("failed", "failed"))])[0]
    assert v == "fail unit: unit failed (failed/failed)"
    _, v = run([healthy(1, models=ModelsAnswer(200, ids=("other",)))])[0]
    assert v.startswith("fail models: /v1/models lists ['other'], not 'llama-8b'")


def test_hung_engine_fails_the_completion_gate_at_its_timeout() -> None:
    hung = CompletionAnswer(None, "timed out after 10s")
    results = run([healthy(t, completion=hung) for t in (2, 12, 23)])
    assert results[0][1].startswith("wait completion: completion: timed out after 10s")
    # the completion gate's clock starts when the gates before it first passed (t=2)
    assert results[2][1].startswith("fail completion:") and "after 21.0s (timeouts.completion=20s)" in results[2][1]


def test_flap_resets_the_soak() -> None:
    aborted = CompletionAnswer(200, text="", finish_reason="abort")
    probes = [healthy(1), healthy(8), healthy(9, completion=aborted), healthy(10), healthy(15), healthy(20)]
    results = run(probes)
    tracks = [t for t, _ in results]
    verdicts = [v for _, v in results]
    assert verdicts[1] == "wait soak: soaking: all gates green for 7.0s of 10s"
    assert verdicts[2].startswith('wait completion: completion finished with finish_reason "abort"')
    assert "(soak reset)" in verdicts[2]
    assert tracks[2].soak_since is None and tracks[2].soak_resets == 1
    assert tracks[3].soak_since == 10
    assert verdicts[4] == "wait soak: soaking: all gates green for 5.0s of 10s"  # not 14 s: the flap reset it
    assert verdicts[5] == "pass soak: all gates green for 10.0s"


def test_a_gate_that_passed_then_keeps_failing_times_out_from_when_it_started_failing() -> None:
    bad = CompletionAnswer(503)
    probes = [healthy(1), healthy(5)] + [healthy(t, completion=bad) for t in (100, 115, 121)]
    verdicts = [v for _, v in run(probes, RolloutPolicy(soak_s=1000, host_deadline_s=1800, timeouts=POLICY.timeouts))]
    assert verdicts[3].startswith("wait completion") and verdicts[3].endswith("15.0s of 20s")
    assert verdicts[4].startswith("fail completion") and "after 21.0s" in verdicts[4]


def test_metric_thresholds_gate_after_completion() -> None:
    expect = Expect("llama-8b", thresholds=(MetricThreshold("vllm:num_requests_waiting", max=2),))
    verdicts = [v for _, v in run([healthy(1, metrics=METRICS)], expect=expect)]
    assert verdicts[0].startswith("wait metrics: vllm:num_requests_waiting <= 2 is violated: 7")


def test_restart_baseline() -> None:
    expect = Expect("llama-8b", baseline_restarts=4)
    assert run([healthy(1, unit=UnitState("active", "running", 4))], expect=expect)[0][1].startswith("wait soak")
    assert run([healthy(1, unit=UnitState("active", "running", 5))], expect=expect)[0][1].startswith("fail unit")


def test_track_round_trips_through_json() -> None:
    track, _ = run([healthy(1), healthy(3)])[-1]
    assert GateTrack.from_dict(track.to_dict()) == track


def test_status_enum_values() -> None:
    assert [s.value for s in Status] == ["pass", "wait", "fail"]


XID79 = GpuEventSeen(2, 1005.0, "XID 79 (reboot): GPU has fallen off the bus", "reboot")
SBE = GpuEventSeen(2, 1004.0, "SBE (info): single-bit ECC error, corrected", "info")


@pytest.mark.parametrize(
    ("seen", "expected", "words"),
    [
        (None, Check.PASS, "not observed"),
        (GpuEvents(()), Check.PASS, "0 corrected or informational"),
        (GpuEvents((SBE,)), Check.PASS, "1 corrected or informational"),
        (GpuEvents((XID79,)), Check.FATAL, "GPU 2 reported XID 79 (reboot): GPU has fallen off the bus"),
        (GpuEvents((SBE, XID79, XID79)), Check.FATAL, "bus after fleet started the instance (and 1 more)"),
        (GpuEvents((GpuEventSeen(0, 1.0, "XID 31 (app): MMU fault", "app"),)), Check.FATAL, "XID 31"),
        (GpuEvents((GpuEventSeen(0, 1.0, "DBE (reset): double-bit", "reset"),)), Check.FATAL, "DBE"),
        (GpuEvents((GpuEventSeen(0, 1.0, "XID 999 (unknown): not in", "unknown"),)), Check.FATAL, "XID 999"),
    ],
)
def test_gpu_gate(seen: GpuEvents | None, expected: Check, words: str) -> None:
    status, detail = check_gpu_events(seen)
    assert status is expected and words in detail


def test_a_gpu_fault_decides_whatever_health_says() -> None:
    loading = Probe(3.0, unit=RUNNING, health=HttpAnswer(None, "connection refused"), gpu_events=GpuEvents((XID79,)))
    assert evaluate(loading, EXPECT) == [
        (
            Gate.GPU,
            Check.FATAL,
            "GPU 2 reported XID 79 (reboot): GPU has fallen off the bus after fleet started the instance",
        )
    ]


def test_an_xid_during_the_soak_fails_the_instance_at_once() -> None:
    probes = [healthy(1, gpu_events=GpuEvents()), healthy(5, gpu_events=GpuEvents((SBE,))),
              healthy(8, gpu_events=GpuEvents((SBE, XID79)))]  # fmt: skip
    verdicts = [v for _, v in run(probes)]
    assert verdicts[:2] == ["wait soak: soaking: all gates green for 0.0s of 10s",
                            "wait soak: soaking: all gates green for 4.0s of 10s"]  # fmt: skip
    assert verdicts[2].startswith("fail gpu: GPU 2 reported XID 79 (reboot)")

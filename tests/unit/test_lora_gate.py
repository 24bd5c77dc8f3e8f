"""The models gate and LoRA adapters: after a restart, ``/v1/models`` must list the planned adapters."""

from __future__ import annotations

import pytest

from fleet.rollout.gates import Check, Expect, HttpAnswer, ModelsAnswer, Probe, UnitState, check_models, evaluate


def listed(*adapters: str, model: str = "llama") -> ModelsAnswer:
    return ModelsAnswer(200, ids=(model, *adapters), adapters=adapters)


@pytest.mark.parametrize(
    ("answer", "planned", "check", "said"),
    [
        (listed("sql"), ("sql",), Check.PASS, "the planned LoRA adapter(s) ['sql']"),
        (listed("b", "a"), ("a", "b"), Check.PASS, "['a', 'b']"),
        (listed(), (), Check.PASS, "no LoRA adapter, as planned"),
        (listed("sql"), None, Check.PASS, "lists 'llama'"),  # files left as they are: not checked
        (listed("sql"), ("chat",), Check.FATAL, "missing ['chat']; not planned ['sql']"),
        (listed(), ("sql",), Check.FATAL, "missing ['sql']"),
        (listed("old", "sql"), ("sql",), Check.FATAL, "not planned ['old']"),
        (listed("sql", model="other"), ("sql",), Check.FATAL, "another model is loaded"),
        (ModelsAnswer(None, "connection refused"), ("sql",), Check.PENDING, "connection refused"),
    ],
)
def test_adapters_listed_must_be_the_planned_ones(
    answer: ModelsAnswer, planned: tuple[str, ...] | None, check: Check, said: str
) -> None:
    got, detail = check_models(answer, "llama", planned)
    assert got is check and said in detail, detail


def test_the_gate_order_stops_at_an_adapter_mismatch() -> None:
    probe = Probe(at=1.0, unit=UnitState("active", "running"), health=HttpAnswer(200), models=listed("old"))
    checks = evaluate(probe, Expect("llama", adapters=("sql",)))
    assert [(g.value, c) for g, c, _ in checks] == [
        ("unit", Check.PASS), ("health", Check.PASS), ("models", Check.FATAL),
    ]  # fmt: skip


def test_the_planned_adapters_survive_the_journal_and_are_not_asked_on_the_way_back() -> None:
    from dataclasses import replace

    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.engine import InstanceState, Target, _inst_from_dict, _inst_to_dict

    ref = InstanceRef("h1", "vllm-0")
    inst = InstanceState(ref, Target(ref, "r2", "llama", 8000, revision="abc", adapters=("sql", "chat")))
    again = _inst_from_dict(_inst_to_dict(inst))
    assert again.target.adapters == ("sql", "chat") and again.adapters == ("sql", "chat")
    assert replace(again, rolling_back=True).adapters is None
    plain = InstanceState(ref, Target(ref, "r2", "llama"))
    assert _inst_from_dict(_inst_to_dict(plain)).target.adapters is None

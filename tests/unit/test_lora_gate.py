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


def test_the_adapters_survive_the_journal_and_the_way_back_expects_the_previous_revisions() -> None:
    from dataclasses import replace

    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.engine import InstanceState, Target, _inst_from_dict, _inst_to_dict
    from fleet.rollout.previous import back_to

    ref = InstanceRef("h1", "vllm-0")
    target = Target(ref, "r2", "llama", 8000, revision="abc", adapters=("sql", "chat"))
    inst = InstanceState(ref, target, previous_release="r1", previous_revision="old", previous_adapters=("sql",))
    again = _inst_from_dict(_inst_to_dict(inst))
    assert again.target.adapters == ("sql", "chat") and again.adapters == ("sql", "chat")
    assert again.previous_adapters == ("sql",) and replace(again, rolling_back=True).adapters == ("sql",)
    assert back_to(again).adapters == ("sql",) and back_to(again).revision == "old"  # `fleet rollback` gates on them
    unknown = replace(again, previous_adapters=None)  # a revision stored before fleet recorded them
    assert replace(unknown, rolling_back=True).adapters is None and back_to(unknown).adapters is None
    plain = InstanceState(ref, Target(ref, "r2", "llama"))
    assert _inst_from_dict(_inst_to_dict(plain)).target.adapters is None
    old_journal = {k: v for k, v in _inst_to_dict(inst).items() if k != "previous_adapters"}
    assert _inst_from_dict(old_journal).previous_adapters is None  # a journal written before: still read


def test_a_revision_records_its_adapters_and_the_host_reads_them_back() -> None:
    from fleet.render.revision import Revision
    from fleet.render.units import RenderedFile
    from fleet.rollout.ssh_executor import adapters_of, served_model_of

    unit = RenderedFile("/etc/systemd/system/fleet-vllm-0.service", "[Service]\n", 0o644)
    env = RenderedFile("/etc/fleet/vllm-0.env", "\n", 0o600)
    meta = Revision("vllm-0", unit, env, "llama", ("sql", "chat")).meta()
    assert adapters_of(meta.strip()) == ("sql", "chat") and served_model_of(meta.strip()) == "llama"
    assert adapters_of(Revision("vllm-0", unit, env, "llama", ()).meta()) == ()  # none planned: checked as none
    assert adapters_of(Revision("vllm-0", unit, env, "llama").meta()) is None  # not recorded: not checked
    for bad in ("", "not json", '{"adapters": "sql"}', '{"adapters": [1]}', "[]"):
        assert adapters_of(bad) is None, bad

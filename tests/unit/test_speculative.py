"""``speculative`` (issue 23 part 2): the inventory key, the draft's memory, refusals, the trade-off."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError, PlanError
from fleet.gpus import HostGpus
from fleet.model.arch import ModelArch, load_model, parse_config
from fleet.plan.extra_args import parse_extra_args
from fleet.plan.planner import plan_host
from fleet.plan.speculative import COMPUTE_BOUND_TOKENS, verdict
from fleet.plan.vllm_surface import parse_serve_argv
from fleet.render.units import exec_lines, unit_file
from tests.unit.conftest import spec
from tests.unit.test_cli_plan import run

H100 = HostGpus.from_catalogue("h100-sxm-80gb", 1)
LLAMA_1B: dict[str, Any] = {  # meta-llama/Llama-3.2-1B-Instruct config.json (the fields fleet reads)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
EAGLE3_HEAD: dict[str, Any] = {  # an EAGLE3 head for Llama-3.1-8B: one decoder layer
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 1,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def target() -> ModelArch:
    return load_model("meta-llama/Llama-3.1-8B-Instruct")


def draft(cfg: dict[str, Any], name: str = "meta-llama/Llama-3.2-1B-Instruct") -> ModelArch:
    return parse_config(cfg, name)


def spec_with(speculative: dict[str, Any], **data: Any) -> Any:
    return spec(speculative=speculative, **data)


# -- the inventory key (fleet.inventory.schema) ---------------------------------------------------


@pytest.mark.parametrize(
    ("speculative", "field", "allowed"),
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "speculative.method", "ngram"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens", "1"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "speculative.num_speculative_tokens", "16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "speculative.num_speculative_tokens", ""),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative", "needs model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "a/b"}, "speculative", "no second model"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": "a/b"}, "speculative", "no second model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative", "prompt_lookup_min 4 must be <= prompt_lookup_max 2"),
        ({"method": "eagle", "num_speculative_tokens": 3, "model": "a/b", "prompt_lookup_max": 2},
         "speculative", "ngram' only"),
        ({"method": "draft_model", "num_speculative_tokens": 3, "model": "-x"}, "speculative.model", ""),
        ({"method": "ngram", "num_speculative_tokens": 3, "tokens": 3}, "speculative.tokens", ""),
    ],
)  # fmt: skip
def test_bad_speculative_is_refused_at_the_inventory(speculative: dict[str, Any], field: str, allowed: str) -> None:
    with pytest.raises(InventoryError) as err:
        spec_with(speculative)
    problems = err.value.problems
    assert any(p.field == field and allowed in p.allowed for p in problems), problems


def test_the_config_json_is_vllms_field_names() -> None:
    sp = spec_with({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}).speculative
    assert json.loads(sp.config_json()) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


# -- the plan ---------------------------------------------------------------------------------------


def _flag(plan: Any, option: str) -> Any:
    return {f.option: f for f in plan.instances[0].flags}.get(option)


def test_ngram_costs_no_memory_and_lands_as_one_json_token() -> None:
    base = plan_host(spec(), H100, target())
    plan = plan_host(spec_with({"method": "ngram", "num_speculative_tokens": 4}), H100, target())
    m, b = plan.instances[0].memory, base.instances[0].memory
    assert (m.weights, m.kv_tokens) == (b.weights, b.kv_tokens)
    flag = _flag(plan, "--speculative-config")
    assert json.loads(flag.value) == {"method": "ngram", "num_speculative_tokens": 4}
    ns = parse_serve_argv(plan.instances[0].argv)  # vLLM 0.33's own parser takes the argv
    assert json.loads(ns.speculative_config) == json.loads(flag.value)


def test_the_json_is_one_word_of_exec_start_even_with_a_hostile_draft_path() -> None:
    path = '/models/draft x $HOME %n "q"'
    sp = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    plan = plan_host(spec_with(sp), H100, target(), draft=draft(LLAMA_1B, path))
    (line,) = [ln for ln in exec_lines(plan.instances[0]) if ln.startswith("--speculative-config")]
    assert "$$HOME" in line and "%%n" in line  # systemd expands neither
    # systemd's unquoting of a double-quoted word is C-style, like the shell's for these characters
    words = shlex.split(line.replace("$$", "$").replace("%%", "%"))
    assert len(words) == 2 and json.loads(words[1])["model"] == path
    assert unit_file(plan, plan.instances[0]).content.count("\nExecStart=") == 1


def test_a_draft_model_takes_its_weights_and_its_share_of_every_kv_block() -> None:
    base = plan_host(spec(), H100, target()).instances[0].memory
    sp = {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 3}
    d = draft(LLAMA_1B)
    m = plan_host(spec_with(sp), H100, target(), draft=d).instances[0].memory
    assert m.draft is not None
    draft_weights = d.parameters * 2  # tied embeddings: counted once
    assert m.weights - base.weights == draft_weights
    # KV: the target's 32 layers and the draft's 16 share each block (same page: 8 KV heads × 128 vs 8 × 64)
    target_block = base.kv_layout.bytes_per_block if base.kv_layout else 0
    draft_block = 16 * 16 * 8 * (64 + 64) * 2
    assert m.draft.kv_bytes_per_block == draft_block
    blocks = m.kv_budget // (target_block + draft_block)
    assert m.kv_blocks == blocks
    assert m.kv_tokens == blocks * 16  # one group, all full attention: vLLM's capacity
    assert m.kv_tokens < base.kv_tokens


def test_mtp_needs_the_models_mtp_layers() -> None:
    with pytest.raises(PlanError) as err:
        plan_host(spec_with({"method": "mtp", "num_speculative_tokens": 1}), H100, target())
    assert "no multi-token-prediction layers" in err.value.problem.summary


def test_mtp_counts_its_layers_kv() -> None:
    cfg = dict(LLAMA_1B, num_nextn_predict_layers=1)
    arch = parse_config(cfg, "x/mtp-model")
    base = plan_host(spec(model="x/mtp-model"), H100, arch).instances[0].memory
    m = plan_host(spec_with({"method": "mtp", "num_speculative_tokens": 1}, model="x/mtp-model"), H100, arch)
    mem = m.instances[0].memory
    assert mem.draft is not None and mem.draft.layers == 1
    assert mem.kv_tokens < base.kv_tokens
    with pytest.raises(PlanError, match="multiple"):
        arch2 = parse_config(dict(LLAMA_1B, num_nextn_predict_layers=2), "x/mtp-model")
        plan_host(spec_with({"method": "mtp", "num_speculative_tokens": 3}, model="x/mtp-model"), H100, arch2)


def test_a_draft_with_another_vocab_is_refused() -> None:
    other = draft(dict(LLAMA_1B, vocab_size=32000), "TinyLlama/TinyLlama-1.1B")
    sp = {"method": "draft_model", "model": "TinyLlama/TinyLlama-1.1B", "num_speculative_tokens": 3}
    with pytest.raises(PlanError) as err:
        plan_host(spec_with(sp), H100, target(), draft=other)
    assert "vocab_size 32000" in err.value.problem.summary and "128256" in err.value.problem.summary


def test_eagle_needs_an_eagle_head() -> None:
    sp = {"method": "eagle3", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 3}
    with pytest.raises(PlanError, match="not an EAGLE head"):
        plan_host(spec_with(sp), H100, target(), draft=draft(LLAMA_1B))
    head = draft(EAGLE3_HEAD, "org/EAGLE3-LLaMA3.1-Instruct-8B")
    sp["model"] = "org/EAGLE3-LLaMA3.1-Instruct-8B"
    m = plan_host(spec_with(sp), H100, target(), draft=head).instances[0].memory
    assert m.draft is not None and m.draft.layers == 1
    assert m.draft.weights == (head.parameters - head.embedding_parameters) * 2  # embeddings shared


@pytest.mark.parametrize(
    ("concurrency", "tokens", "loss"),
    [(1, 4, False), (16, 4, False), (51, 4, False), (52, 4, True), (256, 1, True), (128, 1, False)],
)
def test_the_trade_off(concurrency: int, tokens: int, loss: bool) -> None:
    sp = spec_with({"method": "ngram", "num_speculative_tokens": tokens}).speculative
    got, why = verdict(sp, concurrency)
    assert got is loss
    assert str(concurrency * (tokens + 1)) in why and str(COMPUTE_BOUND_TOKENS) in why


def test_high_concurrency_warns_in_the_plan() -> None:
    work = {"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.0, "target_concurrency": 200}
    plan = plan_host(spec_with({"method": "ngram", "num_speculative_tokens": 4}, workload=work), H100, target())
    assert any("likely a loss" in w for w in plan.warnings)
    low = dict(work, target_concurrency=4)
    plan = plan_host(spec_with({"method": "ngram", "num_speculative_tokens": 4}, workload=low), H100, target())
    assert not any("likely a loss" in w for w in plan.warnings)
    assert "pays" in _flag(plan, "--speculative-config").reason


@pytest.mark.parametrize("flag", ["--speculative-config", "--speculative_config"])
def test_speculative_config_as_an_extra_flag_says_set_speculative(flag: str) -> None:
    parsed = parse_extra_args(((flag, '{"method": "ngram"}'),), "0.33.0")
    ((_, _, why),) = parsed.problems
    assert "set speculative" in why


def _inventory(tmp_path: Path, draft_model: str) -> Path:
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 2000, "p95_output_tokens": 300, "prefix_reuse": 0.0, "target_concurrency": 8}
    sp = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": 4}
    inv.write_text(
        f"h = [('h1', {{'model': 'meta-llama/Llama-3.1-70B-Instruct', 'workload': {wl}, "
        f"'gpu': {{'sku': 'h100-sxm-80gb', 'count': 4}}, 'speculative': {sp}}})]\n"
    )
    return inv


def test_fleet_plan_with_a_draft_model(tmp_path: Path) -> None:
    result = run("plan", str(_inventory(tmp_path, "meta-llama/Llama-3.1-8B-Instruct")), "--offline", "--json")
    assert result.returncode == 0, result.stderr
    (host,) = json.loads(result.stdout)["hosts"]
    inst = host["instances"][0]
    tp = inst["tensor_parallel_size"]
    memory = inst["memory"]
    eight_b = load_model("meta-llama/Llama-3.1-8B-Instruct")
    assert eight_b.checkpoint_bytes is None  # the bundled config has no index: counted by parameters, 16-bit
    assert memory["draft_weights_per_gpu_gib"] == pytest.approx(eight_b.parameters * 2 / tp / 2**30, abs=0.01)
    assert memory["draft_kv_bytes_per_block"] == eight_b.num_layers * eight_b.page_bytes(tp, 2)
    (flag,) = [f for f in inst["flags"] if f["option"] == "--speculative-config"]
    assert json.loads(flag["value"])["model"] == "meta-llama/Llama-3.1-8B-Instruct" and "pays" in flag["reason"]


def test_fleet_plan_refuses_a_draft_with_another_vocab_as_bad_input(tmp_path: Path) -> None:
    result = run("plan", str(_inventory(tmp_path, "mistralai/Mistral-7B-Instruct-v0.3")), "--offline")
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "speculative.model" in out and "vocab_size 32768" in out and "inv.py" in out
    assert "Traceback" not in out


def test_speculative_is_refused_on_multi_node_hosts() -> None:
    with pytest.raises(InventoryError) as err:
        spec_with({"method": "ngram", "num_speculative_tokens": 3}, multi_node=True)
    assert any(p.field == "speculative" and "multi_node" in p.allowed for p in err.value.problems)

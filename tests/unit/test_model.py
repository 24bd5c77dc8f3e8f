"""Model architecture: parameter counts, KV bytes per token per GPU, TP rules, config lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.errors import ModelConfigError
from fleet.model.arch import find_config, load_model, parse_config
from fleet.model.kv import LayerKind

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"

# Published parameter counts (all with an untied LM head).
PARAMS = {
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-70B-Instruct": 70_553_706_496,
    "mistralai/Mistral-7B-Instruct-v0.3": 7_248_023_552,
    "Qwen/Qwen2.5-72B-Instruct": 72_706_203_648,
}

# KV bytes per token per GPU, bf16, vLLM's formula 2 × L × max(1, n_kv // TP) × head_dim × 2.
KV_TABLE = {
    "meta-llama/Llama-3.1-8B-Instruct": {1: 131_072, 2: 65_536, 4: 32_768, 8: 16_384},
    "mistralai/Mistral-7B-Instruct-v0.3": {1: 131_072, 2: 65_536, 4: 32_768, 8: 16_384},
    "meta-llama/Llama-3.1-70B-Instruct": {1: 327_680, 2: 163_840, 4: 81_920, 8: 40_960},
    "Qwen/Qwen2.5-72B-Instruct": {1: 327_680, 2: 163_840, 4: 81_920, 8: 40_960},
}


@pytest.mark.parametrize("model, count", PARAMS.items())
def test_parameter_count_from_architecture_matches_published(model: str, count: int) -> None:
    assert load_model(model).computed_parameters == count


@pytest.mark.parametrize("model", KV_TABLE)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_matches_vllm_table(model: str, tp: int) -> None:
    assert load_model(model).kv_bytes_per_token(tp) == KV_TABLE[model][tp]


def test_kv_heads_replicate_once_tp_exceeds_them() -> None:
    arch = load_model("meta-llama/Llama-3.1-70B-Instruct")  # 8 KV heads
    assert arch.kv_heads_per_gpu(16) == 1
    assert arch.kv_bytes_per_token(16) == arch.kv_bytes_per_token(8)  # stops shrinking past 8
    assert arch.kv_bytes_per_token(8, kv_dtype_bytes=1) == 20_480  # fp8 halves it


def test_mla_latent_cache_is_not_split_by_tp() -> None:
    arch = load_model(str(FIXTURES / "deepseek-v2-lite"))
    assert arch.is_mla and arch.attention_kind == "MLA"
    per_token = 27 * (512 + 64) * 2  # layers × (kv_lora_rank + qk_rope_head_dim) × bf16
    assert [arch.kv_bytes_per_token(tp) for tp in (1, 2, 4, 8)] == [per_token] * 4
    assert arch.is_moe and arch.num_experts == 64 and arch.dense_layers == 1
    assert arch.computed_parameters == pytest.approx(15.7e9, rel=0.01)  # "15.7B" published
    assert arch.max_model_len == 163_840  # yarn factor is not multiplied in


def test_moe_mixtral_counts_every_expert() -> None:
    arch = load_model(str(FIXTURES / "mixtral-8x7b"))
    assert arch.attention_kind == "GQA" and arch.experts_per_token == 2
    assert arch.computed_parameters == 46_702_792_704  # published Mixtral-8x7B total


def test_odd_head_count_limits_tensor_parallel_sizes() -> None:
    arch = load_model(str(FIXTURES / "odd-heads"))
    assert arch.attention_kind == "MHA"
    assert [tp for tp in range(1, 9) if arch.tp_problem(tp) is None] == [1, 5]
    problem = arch.tp_problem(2)
    assert problem is not None and "Total number of attention heads (25)" in problem
    assert arch.dtype_bytes == 2  # an fp32 checkpoint is served as bf16 by --dtype auto
    assert arch.tie_word_embeddings and arch.embedding_parameters == 50304 * 1600


@pytest.mark.parametrize(
    "n_kv, tp, ok",
    [(8, 1, True), (8, 2, True), (8, 8, True), (8, 16, True), (8, 3, False), (4, 8, True), (6, 4, False), (2, 8, True)],
)
def test_kv_head_divisibility_rule(n_kv: int, tp: int, ok: bool) -> None:
    cfg = {"num_attention_heads": 48, "num_key_value_heads": n_kv, "hidden_size": 6144, "num_hidden_layers": 2}
    cfg["intermediate_size"] = 48 * 256
    arch = parse_config(cfg, "synthetic")
    heads_ok = 48 % tp == 0
    assert (arch.tp_problem(tp) is None) == (ok and heads_ok)


def test_rope_factor_multiplies_max_len_only_for_scaled_types() -> None:
    base = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2, "max_position_embeddings": 4096}
    linear = parse_config({**base, "rope_scaling": {"type": "linear", "factor": 4.0}}, "a")
    llama3 = parse_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "b")
    assert (linear.max_model_len, llama3.max_model_len) == (16384, 4096)


def test_sliding_window_off_when_config_disables_it() -> None:
    assert load_model("Qwen/Qwen2.5-72B-Instruct").sliding_window is None  # use_sliding_window: false
    cfg = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2, "sliding_window": 4096}
    assert parse_config(cfg, "x").sliding_window == 4096


def test_quantization_config_is_read() -> None:
    cfg = {
        "num_attention_heads": 8,
        "hidden_size": 512,
        "num_hidden_layers": 2,
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
    }
    q = parse_config(cfg, "x").quantization
    assert q is not None and (q.method, q.bytes_per_param) == ("awq", 0.5)
    fp8 = parse_config({**cfg, "quantization_config": {"quant_method": "fp8"}}, "y").quantization
    assert fp8 is not None and fp8.bits == 8


def test_multimodal_uses_text_config() -> None:
    text = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_hidden_layers": 40}
    arch = parse_config({"model_type": "llava", "text_config": text, "vision_config": {}}, "mm")
    assert (arch.num_layers, arch.num_kv_heads) == (40, 8)


def test_config_found_in_hf_cache_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    cfg = {"num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 3, "torch_dtype": "float16"}
    (snapshot / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert find_config("acme/tiny") == snapshot / "config.json"
    assert load_model("acme/tiny").num_layers == 3


def test_missing_config_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelConfigError) as err:
        load_model("acme/absent")
    assert "acme/absent" in str(err.value) and str(tmp_path) in str(err.value) and "model_config" in str(err.value)


# -- every config.json problem is a ModelConfigError naming file, field, value and what is allowed --

BASE = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
BASE |= {"num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"[1, 2, 3]", "must be a JSON object, not a list"),
        (b'"llama"', "must be a JSON object, not a str"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{not json", "not JSON"),
        (b"", "not JSON"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_unreadable_config_files_are_model_config_errors(tmp_path: Path, raw: bytes, expected: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    with pytest.raises(ModelConfigError) as err:
        load_model(str(tmp_path))
    assert str(path) in str(err.value) and expected in str(err.value)


@pytest.mark.parametrize(
    "change, field, allowed",
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0", "integer from 1 to 4096"),
        ({"num_attention_heads": -8}, "num_attention_heads=-8", "integer from 1"),
        ({"num_attention_heads": "32"}, "num_attention_heads='32'", "must be an integer"),
        ({"num_attention_heads": 32.0}, "num_attention_heads=32.0", "must be an integer"),
        ({"num_attention_heads": True}, "num_attention_heads=True", "must be an integer"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0", "integer from 1"),
        ({"num_key_value_heads": 5}, "num_key_value_heads=5", "must divide num_attention_heads (32)"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000", "integer from 1 to 4096"),
        ({"num_hidden_layers": None}, "num_hidden_layers is missing", "an integer"),
        ({"hidden_size": 2**40}, "hidden_size=1099511627776", "integer from 1 to 1048576"),
        ({"hidden_size": 16}, "num_attention_heads=32", "must not exceed hidden_size (16)"),
        ({"vocab_size": 10**12}, "vocab_size=1000000000000", "integer from 1 to"),
        ({"intermediate_size": -1}, "intermediate_size=-1", "integer from 1"),
        ({"max_position_embeddings": "4k"}, "max_position_embeddings='4k'", "must be an integer"),
        ({"head_dim": 1.5}, "head_dim=1.5", "must be an integer"),
        ({"num_local_experts": 10**9}, "num_local_experts=1000000000", "integer from 0 to 65536"),
        ({"text_config": "llama"}, "text_config='llama'", "must be a JSON object"),
        ({"text_config": {"num_attention_heads": 0}}, "text_config.num_attention_heads=0", "integer from 1"),
        ({"rope_scaling": "linear"}, "rope_scaling='linear'", "must be a JSON object"),
        ({"rope_scaling": {"type": "linear", "factor": "8"}}, "rope_scaling.factor='8'", "positive number"),
        ({"rope_scaling": {"rope_type": 3}}, "rope_scaling.rope_type=3", "must be a string"),
        ({"layer_types": ["full_attention"]}, "layer_types='1 entries'", "one type per layer (32)"),
        ({"layer_types": ["mamba"] * 32}, "layer_types[0]='mamba'", "only attention layers"),
        ({"sliding_window": -4}, "sliding_window=-4", "integer from 1"),
        ({"quantization_config": ["awq"]}, "quantization_config=['awq']", "must be a JSON object"),
        ({"quantization_config": {"quant_method": "awq", "bits": "4"}}, "quantization_config.bits='4'", "integer"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'", "must be true or false"),
        ({"torch_dtype": 16}, "torch_dtype=16", "must be a string"),
    ],
)
def test_bad_config_fields_are_named_with_value_and_what_is_allowed(
    tmp_path: Path, change: dict[str, object], field: str, allowed: str
) -> None:
    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "config.json") in message and field in message and allowed in message, message


def test_huge_layer_count_fails_fast_instead_of_hanging(tmp_path: Path) -> None:
    import time

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_hidden_layers": 10**9}))
    start = time.monotonic()
    with pytest.raises(ModelConfigError):
        load_model(str(tmp_path))
    assert time.monotonic() - start < 5  # a bound, not a speed target: a hang would never return


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_model_config_that_is_missing_or_a_directory_is_an_error_not_a_bundled_fallback(
    tmp_path: Path, kind: str
) -> None:
    target = tmp_path / "cfg"
    if kind == "directory":
        target.mkdir()
    with pytest.raises(ModelConfigError) as err:
        load_model("meta-llama/Llama-3.1-8B-Instruct", str(target))  # the model is bundled: no fallback
    assert str(target) in str(err.value) and ("no such file" in str(err.value) or "directory" in str(err.value))


def test_model_config_directory_with_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_model("acme/x", str(tmp_path)).num_layers == 32


# -- vLLM's derived max length (_get_and_verify_max_len), rule by rule --------------------------

R = {"model_type": "llama", "num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    "extra, limit, default",
    [
        ({"max_position_embeddings": 4096}, 4096, 4096),
        ({"max_position_embeddings": 4096, "n_positions": 2048}, 2048, 2048),  # the smallest key wins
        ({"max_position_embeddings": 4096, "model_max_length": 8192}, 8192, 8192),  # model_max_length overrides
        ({}, 2048, 2048),  # llama's class default max_position_embeddings
        ({"model_type": "unknown"}, 2048, 2048),  # no key at all: vLLM assumes 2048
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384, 16384),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 8192, 8192),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "default"}}, 4096, 4096),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": None}}, 4096, 4096),
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072, 131072),
        ({"max_position_embeddings": 163840, "rope_scaling": {"type": "yarn", "factor": 40}}, 163840, 163840),
        ({"max_position_embeddings": 163840, "rope_scaling": {"type": "deepseek_yarn", "factor": 40}}, 163840, 163840),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "mrope", "factor": 2.0}}, 8192, 8192),
        (
            {
                "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "su", "factor": 32.0},
            },
            131072,
            4096,  # LongRoPE ("su"): the default is the original length
        ),
        (  # Gemma 3: max_position_embeddings is already scaled; the linear factor is not applied
            {
                "model_type": "gemma3_text",
                "max_position_embeddings": 131072,
                "rope_scaling": {"type": "linear", "factor": 8.0},
            },
            131072,
            131072,
        ),
        (  # per-layer-type rope parameters: the scaled type's factor applies
            {
                "max_position_embeddings": 4096,
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}, "sliding_attention": {}},
            },
            8192,
            8192,
        ),
    ],
)
def test_derived_max_len_follows_vllm(extra: dict[str, object], limit: int, default: int) -> None:
    arch = parse_config({**R, **extra}, "x")
    assert (arch.max_model_len, arch.default_max_model_len) == (limit, default)


def test_tokenizer_model_max_length_caps_the_derived_length(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**R, "max_position_embeddings": 32768}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    assert load_model(str(tmp_path)).max_model_len == 8192
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1e30}))  # HF's "no limit"
    assert load_model(str(tmp_path)).max_model_len == 32768


# -- hybrid attention: vLLM's KV-cache groups ------------------------------------------------------


def test_gemma2_alternates_sliding_and_full_layers_in_two_groups() -> None:
    arch = load_model(str(FIXTURES / "gemma-2-9b"))
    assert arch.kinds[:4] == (LayerKind.SLIDING, LayerKind.FULL, LayerKind.SLIDING, LayerKind.FULL)
    layout = arch.kv_layout(tp=1)
    page = 16 * 8 * 2 * 256 * 2  # block × KV heads × (K+V) × head_dim × bf16
    assert layout.page_bytes == page and len(layout.groups) == 2 and layout.bytes_per_block == 21 * page
    # a 2,560-token request: full group 160 blocks; sliding min(4095 + 16384, 2560) → 160 + 1
    assert layout.pages_per_request(2560, 16384) == 160 + 161
    assert layout.tokens(21 * page * 1000, 2560, 16384) == int(1000 / 321 * 2560)


def test_gemma3_five_sliding_to_one_full_is_padded_like_vllm() -> None:
    arch = load_model(str(FIXTURES / "gemma-3-27b"))  # 62 layers: 52 sliding, 10 full
    assert arch.kinds.count(LayerKind.SLIDING) == 52 and arch.sliding_window == 1024
    layout = arch.kv_layout(tp=2)
    assert [(g.kind, g.layers) for g in layout.groups] == [(LayerKind.SLIDING, 9)] + [(LayerKind.SLIDING, 9)] * 3 + [
        (LayerKind.SLIDING, 8)
    ] * 2 + [(LayerKind.FULL, 10)]
    assert layout.padding_layers == 8  # "Add 8 padding layers"
    assert layout.bytes_per_block == 10 * layout.page_bytes
    # at a short context windowed layers cost more than full ones (one extra block, in-flight tokens)
    assert layout.bytes_per_token(2560, 16384) > arch.kv_bytes_per_token(2) * 1.13
    # at a long one far less
    assert layout.bytes_per_token(131072, 16384) < arch.kv_bytes_per_token(2) * 0.5


def test_all_sliding_and_chunked_models_are_one_group() -> None:
    mistral = load_model(str(FIXTURES / "mistral-7b-v0.1")).kv_layout()
    assert len(mistral.groups) == 1 and mistral.groups[0].kind is LayerKind.SLIDING
    assert mistral.pages_per_request(32768, 4096) == -(-(4095 + 4096) // 16) + 1
    scout = load_model(str(FIXTURES / "llama-4-scout"))
    assert scout.kinds.count(LayerKind.CHUNKED) == 36  # 3 of 4 layers use RoPE and chunked attention
    layout = scout.kv_layout(8)  # the hybrid manager is off for chunked attention: all full
    assert len(layout.groups) == 1 and layout.groups[0].kind is LayerKind.FULL and not layout.hybrid


# -- parameters ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("gemma2", True), ("qwen2", False), ("opt", True)])
def test_tie_word_embeddings_defaults_per_model_type(model_type: str, tied: bool) -> None:
    assert parse_config({**R, "model_type": model_type}, "x").tie_word_embeddings is tied
    assert parse_config({**R, "model_type": model_type, "tie_word_embeddings": not tied}, "x").tie_word_embeddings is (
        not tied
    )


def test_multimodal_towers_are_counted() -> None:
    gemma3 = load_model(str(FIXTURES / "gemma-3-27b"))
    assert 0.3e9 < gemma3.tower_parameters < 0.6e9  # SigLIP-so400m and the projector
    assert gemma3.parameters == pytest.approx(27.4e9, rel=0.01)  # "27B": 27.4B published


def test_safetensors_index_total_size_is_the_weight_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**R, "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 123_456_789}}))
    arch = load_model(str(tmp_path))
    assert arch.checkpoint_bytes == 123_456_789
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": "big"}}))
    with pytest.raises(ModelConfigError, match="total_size"):
        load_model(str(tmp_path))


def test_mixtral_expert_width_falls_back_to_intermediate_size() -> None:
    arch = load_model(str(FIXTURES / "mixtral-8x7b"))
    assert arch.moe_intermediate_size == 0 and arch.expert_intermediate_size == 14336

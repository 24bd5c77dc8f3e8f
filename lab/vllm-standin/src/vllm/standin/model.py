"""Finding a model's ``config.json`` and reading its architecture the way vLLM does.

This is an independent implementation from ``vllm.md`` §5 (it must not share code with fleet's
planner: the stand-in is the check on the planner). No network: a model is a local directory
with ``config.json`` or a Hugging Face id already in the HF cache
(``$HF_HUB_CACHE`` or ``$HF_HOME/hub``, ``HF_HOME`` defaulting to ``~/.cache/huggingface``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.standin.log import StartupError

KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
#: RoPE types whose ``factor`` is already reflected in ``max_position_embeddings`` (vllm.md §5).
ROPE_NOT_SCALED = ("llama3", "yarn", "longrope", "su", "mrope", "default")
#: Model types whose attention projections carry a bias (QKV bias adds parameters).
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def hf_hub_dir() -> Path:
    """The HF hub cache directory, honouring ``HF_HUB_CACHE`` and ``HF_HOME``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


def _invalid_model(model: str) -> StartupError:
    return StartupError(
        "ValueError",
        f"Invalid repository ID or local directory specified: '{model}'.\n"
        "Please verify the following requirements:\n"
        "1. Provide a valid Hugging Face repository ID.\n"
        "2. Specify a local directory that contains a recognized configuration file.\n"
        "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
        "   - For Mistral models: ensure the presence of a 'params.json'.",
    )


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The directory holding ``config.json`` for ``model`` (local path or cached HF id)."""
    local = Path(model).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local
        raise _invalid_model(model)
    if model.count("/") != 1:
        raise _invalid_model(model)
    repo = hf_hub_dir() / ("models--" + model.replace("/", "--"))
    snapshots = repo / "snapshots"
    candidates: list[Path] = []
    wanted = revision or "main"
    ref = repo / "refs" / wanted
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    elif revision:
        candidates.append(snapshots / revision)
    elif snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if (snap / "config.json").is_file():
            return snap
    raise _invalid_model(model)


@dataclass(frozen=True)
class ModelArch:
    """What vLLM takes from ``config.json`` (text config for multimodal models)."""

    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int
    moe_intermediate_size: int
    tie_word_embeddings: bool
    config_dtype: str  #: ``dtype``/``torch_dtype`` of the checkpoint, ``float32`` if absent
    derived_max_len: int
    max_len_key: str
    model_max_length: int | None
    quant_method: str | None
    quant_bits: int | None
    use_mla: bool
    kv_lora_rank: int
    qk_rope_head_dim: int

    def param_count(self) -> int:
        """Parameters of a decoder-only transformer (vllm.md §5.1 formula).

        Dense: attention (q, k, v, o [+ QKV bias]) + gated MLP (3·H·I) + two norms per layer,
        embedding, untied lm_head and the final norm. MoE: ``E`` experts of
        ``moe_intermediate_size`` plus a router per layer. Reproduces the published totals of
        the four reference models (e.g. 8,030,261,248 for Llama-3.1-8B).
        """
        h, nh, nkv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h
        if self.model_type in QKV_BIAS_TYPES:
            attn += nh * hd + 2 * nkv * hd
        if self.num_experts > 1:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + head + self.num_layers * per_layer + h

    def embedding_params(self) -> int:
        """Parameters of the embedding and the lm_head (kept in model dtype when quantized)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None


def _derived_max_len(cfg: dict[str, Any], model_dir: Path) -> tuple[int, str, int | None]:
    """vLLM's derived max_model_len: smallest length key, tokenizer limit, RoPE factor."""
    found = [(cfg[key], key) for key in MAX_LEN_KEYS if isinstance(cfg.get(key), int)]
    if found:
        length, key = min(found)
    else:
        length, key = 2048, "default"
    model_max_length = cfg.get("model_max_length") if isinstance(cfg.get("model_max_length"), int) else None
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        tok_max = json.loads(tok_cfg.read_text()).get("model_max_length")
        if isinstance(tok_max, int):
            model_max_length = tok_max if model_max_length is None else min(model_max_length, tok_max)
            length = min(length, tok_max)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if rope_type not in ROPE_NOT_SCALED and isinstance(factor, (int, float)):
            length = int(length * factor)
    return length, key, model_max_length


def read_arch(model_dir: Path) -> ModelArch:
    """Architecture of the model in ``model_dir`` (reads ``config.json``)."""
    full = json.loads((model_dir / "config.json").read_text())
    cfg: dict[str, Any] = full.get("text_config") or full
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
    except KeyError as exc:
        raise StartupError("KeyError", f"config.json of {model_dir} has no {exc}") from None
    kv = _first(cfg, KV_HEAD_KEYS)
    num_kv = int(kv[1]) if kv else heads
    model_type = str(full.get("model_type", cfg.get("model_type", "")))
    kv_lora_rank = int(cfg.get("kv_lora_rank") or 0)
    rope_dim = int(cfg.get("qk_rope_head_dim") or 0)
    use_mla = kv_lora_rank > 0
    if use_mla:
        head_dim = kv_lora_rank + rope_dim
    elif int(cfg.get("head_dim") or 0) > 0:
        head_dim = int(cfg["head_dim"])
    elif int(cfg.get("hidden_size_per_head") or 0) > 0:
        head_dim = int(cfg["hidden_size_per_head"])
    else:
        head_dim = hidden // heads
    experts = _first(cfg, EXPERT_KEYS)
    dtype = full.get("dtype") or full.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    quant = full.get("quantization_config") or full.get("compression_config")
    quant_method = str(quant.get("quant_method", quant.get("quant_algo", ""))).lower() if quant else None
    quant_bits = int(quant["bits"]) if quant and isinstance(quant.get("bits"), int) else None
    max_len, max_key, model_max_length = _derived_max_len(cfg, model_dir)
    return ModelArch(
        model_type=model_type,
        architectures=tuple(full.get("architectures") or ()),
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab_size=int(cfg.get("vocab_size") or 32000),
        num_experts=int(experts[1]) if experts else 1,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", full.get("tie_word_embeddings", False))),
        config_dtype=str(dtype) if dtype else "float32",
        derived_max_len=max_len,
        max_len_key=max_key,
        model_max_length=model_max_length,
        quant_method=quant_method,
        quant_bits=quant_bits,
        use_mla=use_mla,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
    )


def weight_bytes_per_gpu(arch: ModelArch, dtype_bytes: int, quantization: str | None, shards: int) -> int:
    """Weight memory on one GPU: ``params × bytes / (TP × PP)``.

    Embedding/lm_head stay in the model dtype; linear layers take ``bits/8`` bytes for 4/8-bit
    checkpoints (``quantization_config.bits``) or 1 byte for FP8 (on-the-fly ``--quantization
    fp8`` or an FP8 checkpoint), plus ~3% for scales. The small replicated parts (norms) are
    ignored, as is vocab padding to 64.
    """
    total = arch.param_count()
    embed = arch.embedding_params()
    method = quantization or arch.quant_method
    if method is None:
        nbytes = total * dtype_bytes
    else:
        linear = total - embed
        if arch.quant_bits in (2, 3, 4, 8):
            per = arch.quant_bits / 8
        elif "fp8" in method or method in ("modelopt", "compressed-tensors", "fbgemm_fp8"):
            per = 1.0
        elif "fp4" in method or "mxfp4" in method:
            per = 0.5
        else:
            per = 0.5 if "awq" in method or "gptq" in method else float(dtype_bytes)
        nbytes = int(embed * dtype_bytes + linear * per * 1.03)
    return math.ceil(nbytes / shards)

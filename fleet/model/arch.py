"""Model architecture from a Hugging Face ``config.json``, read the way vLLM 0.33 reads it.

``ModelArch`` holds what the serving plan needs: layers, heads, KV heads, head_dim, sizes,
dtype, maximum length, MoE and MLA shape, sliding window, quantization. ``kv_bytes_per_token``
follows vLLM's own per-GPU formula (``shared/reference/vllm.md`` §2.2), including KV-head
replication when TP exceeds the KV-head count and MLA's unsplit latent cache.

Configs are found without network: an explicit path, the local Hugging Face cache layout
(``$HF_HUB_CACHE`` or ``$HF_HOME/hub``: ``models--org--name/snapshots/<rev>/config.json``), then
the reference configs bundled with fleet (``fleet/data/models``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.errors import ModelConfigError

BUNDLED_MODELS = Path(__file__).resolve().parents[1] / "data" / "models"

#: Where vLLM reads the KV-head count, first match wins (transformers_utils/config.py).
_KV_HEAD_KEYS = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)
#: Where vLLM reads the maximum length; the smallest wins (model_arch_config_convertor).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: RoPE types whose ``factor`` vLLM does not multiply into the derived max length.
_ROPE_NOT_SCALED = {"llama3", "yarn", "longrope", "su", "mrope", "default"}
_EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_selected_experts")

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class Quantization:
    """The checkpoint's own ``quantization_config``: method and bits per weight."""

    method: str
    bits: float

    @property
    def bytes_per_param(self) -> float:
        return self.bits / 8


@dataclass(frozen=True)
class ModelArch:
    """The architecture facts of one model that serving memory depends on."""

    name: str
    source: str  #: where config.json was read from
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int  #: vLLM's derived max length
    dtype: str
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0  #: leading dense layers in a MoE model (DeepSeek ``first_k_dense_replace``)
    kv_lora_rank: int = 0  #: MLA latent size (0: not MLA)
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    sliding_window: int | None = None
    quantization: Quantization | None = None
    declared_parameters: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of activations/KV under ``--dtype auto``: FP32 is served as BF16."""
        return min(DTYPE_BYTES.get(self.dtype, 2), 2)

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        if self.num_kv_heads < self.num_attention_heads:
            return "GQA"
        return "MHA"

    # -- parameters ---------------------------------------------------------------------------

    def _attention_params(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        hd, kv = self.head_dim, self.num_kv_heads
        params = h * n * hd + 2 * h * kv * hd + n * hd * h
        if self.attention_bias:
            params += n * hd + 2 * kv * hd
        return params

    def _mlp_params(self, layer: int) -> int:
        h = self.hidden_size
        if not self.is_moe or layer < self.dense_layers:
            return 3 * h * self.intermediate_size
        expert = self.moe_intermediate_size or self.intermediate_size
        params = self.num_experts * 3 * h * expert + h * self.num_experts  # experts + router
        params += self.shared_experts * 3 * h * expert
        if self.shared_expert_intermediate_size:
            params += 3 * h * self.shared_expert_intermediate_size + h  # Qwen-MoE shared expert + gate
        return params

    @property
    def computed_parameters(self) -> int:
        """Parameter count from the architecture (``vllm.md`` §5.1 formula, extended to MoE/MLA)."""
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        layers = sum(self._attention_params() + self._mlp_params(i) + 2 * h for i in range(self.num_layers))
        return embeddings + layers + h

    @property
    def parameters(self) -> int:
        return self.declared_parameters or self.computed_parameters

    @property
    def embedding_parameters(self) -> int:
        """Input embedding and LM head: these stay 16-bit in quantized checkpoints."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    # -- KV cache ----------------------------------------------------------------------------

    def kv_heads_per_gpu(self, tp: int) -> int:
        """vLLM's ``get_num_kv_heads``: heads split over TP, one per rank once TP exceeds them."""
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype_bytes: int | None = None, pp: int = 1) -> int:
        """KV-cache bytes one token takes on one GPU, exactly as vLLM 0.33 sizes its pages.

        Full attention: ``2 × L/PP × max(1, n_kv // TP) × head_dim × bytes``.
        MLA: ``L/PP × (kv_lora_rank + qk_rope_head_dim) × bytes``, not divided by TP.
        """
        nbytes = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        layers = -(-self.num_layers // pp)
        if self.is_mla:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * nbytes
        return 2 * layers * self.kv_heads_per_gpu(tp) * self.head_dim * nbytes

    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM would refuse this tensor-parallel size for this model, or None.

        Rules from vLLM 0.33 (``vllm.md`` §3): attention heads divisible by TP; KV heads
        divisible by TP, or TP a multiple of the KV heads (replication); the MLP split integral.
        """
        if tp < 1:
            return "tensor parallel size must be at least 1"
        if self.num_attention_heads % tp:
            return (
                f"Total number of attention heads ({self.num_attention_heads}) must be divisible "
                f"by tensor parallel size ({tp})."
            )
        if not self.is_mla:
            kv = self.num_kv_heads
            if tp >= kv and tp % kv:
                return f"{tp} is not divisible by {kv} (TP exceeds the {kv} KV heads but is not a multiple)"
            if tp < kv and kv % tp:
                return f"{kv} is not divisible by {tp} (KV heads must split evenly over TP)"
        mlp = self.moe_intermediate_size if self.is_moe else self.intermediate_size
        if mlp % tp:
            return f"intermediate size {mlp} is not divisible by tensor parallel size {tp}"
        return None


# -- reading config.json ----------------------------------------------------------------------


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _derived_max_len(cfg: dict[str, Any]) -> int:
    lengths = [int(cfg[k]) for k in _MAX_LEN_KEYS if isinstance(cfg.get(k), int)]
    if isinstance(cfg.get("model_max_length"), int):
        lengths = [int(cfg["model_max_length"])]
    length = min(lengths) if lengths else 2048
    rope = cfg.get("rope_scaling") or {}
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    factor = rope.get("factor")
    if isinstance(factor, int | float) and rope_type not in _ROPE_NOT_SCALED:
        length = int(length * factor)
    return length


def _quantization(cfg: dict[str, Any]) -> Quantization | None:
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    bits: float
    if "bits" in q:
        bits = float(q["bits"])
    elif "w_bit" in q:
        bits = float(q["w_bit"])
    elif "fp8" in method or method in ("fbgemm_fp8", "modelopt"):
        bits = 8
    elif "fp4" in method or "mxfp4" in method:
        bits = 4
    else:
        groups = q.get("config_groups") or {}
        weights = [g.get("weights", {}) for g in groups.values() if isinstance(g, dict)]
        bits = float(weights[0].get("num_bits", 8)) if weights else 8
    return Quantization(method=method, bits=bits)


def parse_config(cfg: dict[str, Any], name: str, source: str = "") -> ModelArch:
    """Build a ``ModelArch`` from the dict of a ``config.json`` (multimodal: its text config)."""
    text = cfg.get("text_config") or cfg.get("llm_config") or cfg
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
    except KeyError as missing:
        raise ModelConfigError(f"{source or name}: config.json has no {missing.args[0]!r}") from None
    kv_lora = int(text.get("kv_lora_rank") or 0)
    rope_dim = int(text.get("qk_rope_head_dim") or 0)
    if kv_lora:
        head_dim = kv_lora + rope_dim
    elif int(text.get("head_dim") or 0) > 0:
        head_dim = int(text["head_dim"])
    else:
        head_dim = hidden // heads
    sliding = text.get("sliding_window")
    if text.get("use_sliding_window") is False:
        sliding = None
    dtype = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype") or "float32")
    experts = int(_first(text, _EXPERT_KEYS, 0) or 0)
    return ModelArch(
        name=name,
        source=source,
        model_type=str(text.get("model_type") or cfg.get("model_type") or "unknown"),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(text, _KV_HEAD_KEYS, heads)),
        head_dim=head_dim,
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        vocab_size=int(text.get("vocab_size") or cfg.get("vocab_size") or 32000),
        max_model_len=_derived_max_len(text),
        dtype=dtype.replace("torch.", ""),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_bias=bool(text.get("attention_bias", text.get("model_type") in ("qwen2", "qwen2_moe"))),
        num_experts=experts,
        experts_per_token=int(_first(text, _TOPK_KEYS, 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        shared_experts=int(text.get("n_shared_experts") or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        dense_layers=int(text.get("first_k_dense_replace") or 0) if experts else 0,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0),
        v_head_dim=int(text.get("v_head_dim") or 0),
        q_lora_rank=int(text.get("q_lora_rank") or 0),
        sliding_window=int(sliding) if isinstance(sliding, int) else None,
        quantization=_quantization(cfg),
        declared_parameters=int(cfg["num_parameters"]) if isinstance(cfg.get("num_parameters"), int) else None,
    )


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache directories, in the order ``huggingface_hub`` uses them."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    dirs.append(hf_home / "hub")
    return dirs


def find_config(model: str, explicit: str | None = None) -> Path:
    """Locate ``config.json`` for ``model`` without network; ``ModelConfigError`` names where it looked."""
    looked: list[str] = []
    candidates: list[Path] = []
    for raw in (explicit, model):
        if raw and (raw.startswith(("/", ".", "~")) or raw.endswith(".json")):
            path = Path(raw).expanduser()
            candidates.append(path if path.suffix == ".json" else path / "config.json")
    if "/" in model and not model.startswith(("/", ".", "~")):
        repo = "models--" + model.replace("/", "--")
        for cache in hf_cache_dirs():
            snapshots = cache / repo / "snapshots"
            looked.append(str(snapshots))
            if snapshots.is_dir():
                candidates += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        candidates.append(BUNDLED_MODELS / model / "config.json")
    for candidate in candidates:
        looked.append(str(candidate))
        if candidate.is_file():
            return candidate
    raise ModelConfigError(
        f"no config.json for model {model!r}; looked in: {', '.join(dict.fromkeys(looked))}. "
        "Put the model in the local Hugging Face cache, or set model_config to a config.json path."
    )


def load_model(model: str, explicit: str | None = None) -> ModelArch:
    """Find and parse the config of ``model`` (HF id or path)."""
    path = find_config(model, explicit)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read config.json: {exc}") from exc
    return parse_config(cfg, name=model, source=str(path))

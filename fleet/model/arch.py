"""Model architecture from a Hugging Face ``config.json``, read the way vLLM 0.33 reads it.

``ModelArch`` holds what the serving plan needs: layers, heads, KV heads, head_dim, sizes,
dtype, derived maximum length (``fleet.model.max_len``), MoE and MLA shape, the attention kind
of every layer and vLLM's KV-cache groups (``fleet.model.kv``), quantization, and the weight
size (``model.safetensors.index.json`` when present, else counted from the architecture).
Field names and fallbacks follow ``vllm/transformers_utils/model_arch_config_convertor.py``
and ``vllm/transformers_utils/config.py`` (``CONFIG_FIELD_ALIASES``).

Configs are found and read by ``fleet.model.config``: every problem is a ``ModelConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleet.errors import ModelConfigError
from fleet.model.config import (
    BOUNDS,
    BUNDLED_MODELS,
    ConfigReader,
    find_config,
    hf_cache_dirs,
    read_checkpoint,
    with_class_defaults,
)
from fleet.model.kv import KvLayout, LayerKind, kv_layout, layer_kinds
from fleet.model.max_len import MaxLen, derive_max_len
from fleet.model.params import tie_word_embeddings, tower_parameters

__all__ = ["BUNDLED_MODELS", "ModelArch", "Quantization", "find_config", "hf_cache_dirs", "load_model", "parse_config"]

#: Where vLLM reads the KV-head count, first match wins (transformers_utils/config.py).
_KV_HEAD_KEYS = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)
_EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_selected_experts")

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class Quantization:
    """The checkpoint's own ``quantization_config``: method and bits per weight."""

    method: str
    bits: float
    #: ``weight_block_size`` [block_n, block_k] of a block-quantized FP8 checkpoint (``quant_method:
    #: fp8``, read as vLLM's ``Fp8Config.from_config`` reads it); None: per-tensor or not FP8
    weight_block_size: tuple[int, int] | None = None

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
    attention_chunk_size: int | None = None
    quantization: Quantization | None = None
    declared_parameters: int | None = None
    #: attention kind of every layer (empty: all full attention)
    layer_kinds: tuple[LayerKind, ...] = ()
    #: how vLLM derived ``max_model_len`` (None: given directly, e.g. in tests)
    max_len: MaxLen | None = field(default=None, compare=False)
    #: estimated parameters of vision/audio towers and projectors
    tower_parameters: int = 0
    #: ``model.safetensors.index.json`` ``metadata.total_size``: the checkpoint's weight bytes
    checkpoint_bytes: int | None = None
    #: ``num_nextn_predict_layers``: the multi-token-prediction layers vLLM's ``mtp`` method drafts with
    mtp_layers: int = 0
    #: ``architectures`` of config.json (an EAGLE head names itself there, e.g. ``LlamaForCausalLMEagle3``)
    architectures: tuple[str, ...] = ()

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

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one expert's MLP: ``moe_intermediate_size``, else ``intermediate_size`` (Mixtral)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def default_max_model_len(self) -> int:
        """What vLLM uses without ``--max-model-len`` (LongRoPE: the original length)."""
        return self.max_len.default if self.max_len is not None else self.max_model_len

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        return self.layer_kinds or (LayerKind.FULL,) * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        return len(set(self.kinds)) > 1

    def _mlp_params(self, layer: int) -> int:
        h = self.hidden_size
        if not self.is_moe or layer < self.dense_layers:
            return 3 * h * self.intermediate_size
        expert = self.expert_intermediate_size
        params = self.num_experts * 3 * h * expert + h * self.num_experts  # experts + router
        params += self.shared_experts * 3 * h * expert
        if self.shared_expert_intermediate_size:
            params += 3 * h * self.shared_expert_intermediate_size + h  # Qwen-MoE shared expert + gate
        return params

    def layer_parameters(self, layer: int) -> int:
        """Parameters of one decoder layer (attention, norms, MLP or experts): what a pipeline stage loads."""
        return self._attention_params() + 2 * self.hidden_size + self._mlp_params(layer)

    @property
    def computed_parameters(self) -> int:
        """Parameter count from the architecture.

        Embeddings, attention, MLP and norms per layer; MoE experts and router; MLA projections;
        estimated vision/audio towers.
        """
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense = min(self.dense_layers, self.num_layers) if self.is_moe else self.num_layers
        per_layer = self._attention_params() + 2 * h
        layers = self.num_layers * per_layer + dense * self._mlp_params(0)
        if dense < self.num_layers:
            layers += (self.num_layers - dense) * self._mlp_params(self.num_layers - 1)
        return embeddings + layers + h + self.tower_parameters

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

    def page_bytes(self, tp: int = 1, kv_dtype_bytes: int | None = None, block_size: int = 16) -> int:
        """One layer's KV page (``block_size`` tokens) on one GPU: vLLM's ``page_size_bytes``."""
        nbytes = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        if self.is_mla:
            return block_size * (self.kv_lora_rank + self.qk_rope_head_dim) * nbytes
        return block_size * self.kv_heads_per_gpu(tp) * 2 * self.head_dim * nbytes

    def kv_layout(self, tp: int = 1, kv_dtype_bytes: int | None = None) -> KvLayout:
        """vLLM 0.33's KV-cache groups of this model on one GPU of a TP group."""
        return kv_layout(
            self.kinds, self.page_bytes(tp, kv_dtype_bytes), self.sliding_window, self.attention_chunk_size
        )

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

        Rules from vLLM 0.33 (``ModelConfig.verify_with_parallel_config`` in ``vllm/config/model.py``,
        ``QKVParallelLinear`` in ``vllm/model_executor/layers/linear.py``): attention heads divisible by TP; KV heads
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
        mlp = self.expert_intermediate_size if self.is_moe else self.intermediate_size
        if mlp % tp:
            return f"intermediate size {mlp} is not divisible by tensor parallel size {tp}"
        return None


# -- reading config.json ----------------------------------------------------------------------


def _quantization(top: ConfigReader) -> Quantization | None:
    key = "quantization_config" if top.has("quantization_config") else "compression_config"
    q = top.sub(key)
    if q is None:
        return None
    method = (q.string("quant_method") or q.string("quant_algo") or "unknown").lower()
    bits: float
    if q.has("bits"):
        bits = float(q.integer("bits", bounds=(1, 32)))
    elif q.has("w_bit"):
        bits = float(q.integer("w_bit", bounds=(1, 32)))
    elif "fp8" in method or method in ("fbgemm_fp8", "modelopt"):
        bits = 8
    elif "fp4" in method or "mxfp4" in method:
        bits = 4
    else:
        groups = q.mapping("config_groups") or {}
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
        first = weights[0] if weights and isinstance(weights[0], dict) else {}
        bits = float(ConfigReader(first, q.source, f"{q.prefix}config_groups.weights.").integer("num_bits", 8, (1, 32)))
    return Quantization(method=method, bits=bits, weight_block_size=_weight_block_size(q, method))


def _weight_block_size(q: ConfigReader, method: str) -> tuple[int, int] | None:
    """``Fp8Config``'s ``weight_block_size`` (vLLM refuses one that is not two dimensions)."""
    raw = q.items("weight_block_size")
    if method != "fp8" or raw is None:
        return None
    if len(raw) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 16 for v in raw):
        raise q.fail("weight_block_size", raw, "must be two positive integers [block_n, block_k], e.g. [128, 128]")
    return raw[0], raw[1]


def _text_config(top: ConfigReader) -> ConfigReader:
    """The language model's config: ``text_config`` (multimodal) or the config itself."""
    for key in ("text_config", "llm_config", "language_config"):
        if key in top.cfg and top.cfg[key] is not None:
            sub = top.sub(key)
            assert sub is not None
            return sub
    return top


def parse_config(
    cfg: dict[str, Any],
    name: str,
    source: str = "",
    tokenizer_config: dict[str, Any] | None = None,
    checkpoint_bytes: int | None = None,
) -> ModelArch:
    """Build a ``ModelArch`` from the dict of a ``config.json``; ``ModelConfigError`` names any bad field."""
    where = source or name
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{where}: a config.json must be a JSON object, not a {type(cfg).__name__}")
    top = ConfigReader(with_class_defaults(cfg), where)
    text = _text_config(top)
    model_type = text.string("model_type") or top.string("model_type") or "unknown"
    heads = text.integer("num_attention_heads")
    hidden = text.integer("hidden_size")
    layers = text.integer("num_hidden_layers")
    kv_lora = text.integer("kv_lora_rank", 0, (0, BOUNDS["kv_lora_rank"][1]))
    rope_dim = text.integer("qk_rope_head_dim", 0, (0, BOUNDS["qk_rope_head_dim"][1]))
    kv_heads = text.first_int(_KV_HEAD_KEYS, heads, BOUNDS["num_key_value_heads"])
    if kv_lora:
        head_dim = kv_lora + rope_dim
    elif text.has("head_dim") and text.integer("head_dim", bounds=(0, BOUNDS["head_dim"][1])) > 0:
        head_dim = text.integer("head_dim")
    elif text.has("hidden_size_per_head"):
        head_dim = text.integer("hidden_size_per_head", bounds=BOUNDS["head_dim"])
    else:
        head_dim = hidden // heads
        if head_dim == 0:
            raise text.fail("num_attention_heads", heads, f"must not exceed hidden_size ({hidden}) without a head_dim")
    if not kv_lora and heads % kv_heads:
        raise text.fail(
            "num_key_value_heads",
            kv_heads,
            f"must divide num_attention_heads ({heads}): each KV head serves a whole group of query heads",
        )
    sliding = text.optional_int("sliding_window")
    if not text.boolean("use_sliding_window", True):
        sliding = None
    dtype = text.string("dtype") or text.string("torch_dtype") or top.string("dtype") or top.string("torch_dtype")
    dtype = (dtype or "float32").replace("torch.", "")
    experts = text.first_int(_EXPERT_KEYS, 0, (0, BOUNDS["num_experts"][1]))
    kinds = layer_kinds(text, model_type, layers)
    chunk = text.optional_int("attention_chunk_size")
    max_len = derive_max_len(text, model_type, tokenizer_config)
    declared = top.optional_int("num_parameters", bounds=(1, 1 << 50))
    return ModelArch(
        name=name,
        source=source,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=text.integer("intermediate_size", 4 * hidden),
        vocab_size=text.integer("vocab_size", top.integer("vocab_size", 32000)),
        max_model_len=max_len.limit,
        dtype=dtype,
        tie_word_embeddings=tie_word_embeddings(top, text, model_type),
        attention_bias=text.boolean("attention_bias", model_type in ("qwen2", "qwen2_moe")),
        num_experts=experts,
        experts_per_token=text.first_int(_TOPK_KEYS, 0, (0, BOUNDS["num_experts_per_tok"][1])),
        moe_intermediate_size=text.integer("moe_intermediate_size", 0, (0, BOUNDS["moe_intermediate_size"][1])),
        shared_experts=text.integer("n_shared_experts", 0, (0, BOUNDS["n_shared_experts"][1])),
        shared_expert_intermediate_size=text.integer(
            "shared_expert_intermediate_size", 0, (0, BOUNDS["shared_expert_intermediate_size"][1])
        ),
        dense_layers=text.integer("first_k_dense_replace", 0, (0, 4096)) if experts else 0,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=text.integer("qk_nope_head_dim", 0, (0, BOUNDS["qk_nope_head_dim"][1])),
        v_head_dim=text.integer("v_head_dim", 0, (0, BOUNDS["v_head_dim"][1])),
        q_lora_rank=text.integer("q_lora_rank", 0, (0, BOUNDS["q_lora_rank"][1])),
        sliding_window=sliding if LayerKind.SLIDING in kinds else None,
        attention_chunk_size=chunk if LayerKind.CHUNKED in kinds else None,
        quantization=_quantization(top),
        declared_parameters=declared,
        layer_kinds=kinds,
        max_len=max_len,
        tower_parameters=tower_parameters(top, hidden),
        checkpoint_bytes=checkpoint_bytes,
        mtp_layers=text.integer("num_nextn_predict_layers", 0, (0, 64)),
        architectures=tuple(a for a in (top.items("architectures") or ()) if isinstance(a, str)),
    )


def load_model(model: str, explicit: str | None = None) -> ModelArch:
    """Find and parse the config of ``model`` (HF id or path), with its tokenizer config and index."""
    checkpoint = read_checkpoint(find_config(model, explicit))
    return parse_config(
        checkpoint.config,
        name=model,
        source=str(checkpoint.path),
        tokenizer_config=checkpoint.tokenizer_config,
        checkpoint_bytes=checkpoint.weights_total_size,
    )

"""LoRA adapters and ``--speculative-config``, taken and refused as vLLM 0.33.0 does.

LoRA:

* ``--lora-modules`` items are ``name=path`` or a JSON object ``{"name", "path",
  "base_model_name"?}`` (``LoRAParserAction`` in ``vllm/entrypoints/common/cli_args.py``);
* ``LoRAConfig`` (``vllm/config/lora.py``): ``max_cpu_loras`` defaults to ``max_loras`` and must
  not be below it;
* each static adapter is loaded before the server listens (``OpenAIServingModels.init_static_loras``,
  ``vllm/entrypoints/openai/models/serving.py``): its path is resolved by
  ``get_adapter_absolute_path`` (``vllm/lora/utils.py``: an absolute path as is, an existing relative
  path made absolute, else a Hub id answered from the cache, ``refs/main``, offline); its
  ``adapter_config.json`` is read (``PEFTHelper.from_local_dir``) and checked
  (``PEFTHelper.validate_legal``: the rank against ``max_lora_rank``, ``bias``); a failure ends the
  start-up with ``ValueError`` and vLLM's message;
* ``/v1/models`` lists each adapter after the base model: ``id`` its name, ``root`` its path as
  given, ``parent`` its ``base_model_name`` or the first served name, no ``max_model_len``
  (``OpenAIServingModels.show_available_models``); a completion may name it as ``model``;
* the slots: with ``--enable-lora`` the worker allocates ``max_loras`` slots of ``max_lora_rank`` on
  every wrapped layer while it loads the model, so they are measured as weights
  (``create_lora_weights`` in ``vllm/lora/layers/``): ``slot_bytes`` here.

Speculative decoding: ``--speculative-config`` is JSON (``SpeculativeConfig``,
``vllm/config/speculative.py``): ``method`` one of vLLM's, ``num_speculative_tokens`` > 0, n-gram
lookup bounds defaulting to 5 and min <= max, a ``model`` for ``draft_model``/``eagle``/``eagle3``.
The stand-in proposes nothing; it takes the config and logs it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.standin.log import StartupError
from vllm.standin.model import ModelArch, hf_hub_dir

#: ``MaxLoRARanks`` in ``vllm/config/lora.py``
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: ``SpeculativeMethod`` names of ``vllm/config/speculative.py`` the stand-in takes
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix")
#: Architectures whose vLLM model class has no ``embedding_modules`` (no embedding/logits slots).
NO_EMBEDDING_LORA = ("Qwen2ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
PACKED_IN_CHECKPOINT = ("Phi3ForCausalLM",)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str  #: as given on the command line (``/v1/models`` shows it as ``root``)
    base_model_name: str | None
    rank: int


def parse_modules(items: list[str] | None) -> list[tuple[str, str, str | None]]:
    """``(name, path, base_model_name)`` of each ``--lora-modules`` item, as ``LoRAParserAction``."""
    out: list[tuple[str, str, str | None]] = []
    for item in items or []:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            out.append((name, path, None))
            continue
        try:
            raw = json.loads(item)
        except json.JSONDecodeError:
            raise StartupError("SystemExit", f"Invalid JSON format for --lora-modules: {item}") from None
        if (
            not isinstance(raw, dict)
            or not {"name", "path"} <= set(raw)
            or set(raw) - {"name", "path", "base_model_name"}
        ):
            raise StartupError("SystemExit", f"Invalid fields for --lora-modules: {item}")
        out.append((str(raw["name"]), str(raw["path"]), raw.get("base_model_name")))
    return out


def resolve(path: str) -> Path | None:
    """``get_adapter_absolute_path``: the adapter's directory, or None when the cache has no such repo."""
    if os.path.isabs(path):
        return Path(path)
    if path.startswith("~"):
        return Path(path).expanduser()
    if os.path.exists(path):
        return Path(path).absolute()
    repo = hf_hub_dir() / ("models--" + path.replace("/", "--"))
    ref = repo / "refs" / "main"
    if path.count("/") == 1 and ref.is_file():
        return repo / "snapshots" / ref.read_text().strip()
    return None


def load_adapters(args: Any) -> list[Adapter]:
    """The static adapters, loaded and checked as vLLM does before it listens (``StartupError``)."""
    modules = parse_modules(args.lora_modules)
    if not args.enable_lora:
        return []
    max_loras, rank = int(args.max_loras), int(args.max_lora_rank)
    cpu = int(args.max_cpu_loras) if args.max_cpu_loras is not None else max_loras
    if cpu < max_loras:
        raise StartupError("ValueError", f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras}).")
    out = []
    for name, path, base in modules:
        where = resolve(path)
        config = where / "adapter_config.json" if where is not None else None
        if config is None or not config.is_file():
            # LoRAAdapterNotFoundError (vllm/entrypoints/openai/engine/protocol.py), raised by init_static_loras
            raise StartupError("ValueError", f"Loading lora {name} failed: No adapter found for {path}")
        try:
            peft = json.loads(config.read_text())
        except ValueError as exc:
            raise StartupError("ValueError", f"{config}: {exc}") from None
        ranks = [int(peft.get("r", 0)), *(int(v) for v in (peft.get("rank_pattern") or {}).values())]
        problems = []
        if max(ranks) > rank:
            problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {rank}.")
        if peft.get("bias", "none") != "none":
            problems.append("Adapter bias is not supported.")
        if problems:
            raise StartupError("ValueError", " ".join(problems))
        out.append(Adapter(name, path, base, max(ranks)))
    return out


def slot_bytes(args: Any, arch: ModelArch, tp: int, dtype_bytes: int) -> int:
    """Bytes of the LoRA slots on one GPU (0 without ``--enable-lora``): per decoder layer
    q/k/v (3 slices, or 1 where the checkpoint packs them), o, gate/up (2 or 1) and down, each
    ``lora_a`` + ``lora_b`` of ``max_loras × rank``; plus the embedding and logits processor."""
    if not args.enable_lora:
        return 0
    rank, loras = int(args.max_lora_rank), int(args.max_loras)
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_heads * hd // tp
    kv = max(1, arch.num_kv_heads // tp) * hd
    inter = arch.intermediate_size // tp
    packed = any(a in PACKED_IN_CHECKPOINT for a in arch.architectures)
    per_layer = (
        ((1 if packed else 3) * h + q + 2 * kv)  # q/k/v: lora_a per slice + lora_b of each output
        + (q + h)  # o_proj (row-parallel): a over its input shard, b the whole hidden
        + ((1 if packed else 2) * h + 2 * inter)  # gate/up
        + (inter + h)  # down_proj
    ) * rank
    embeddings = 0 if any(a in NO_EMBEDDING_LORA for a in arch.architectures) else 2 * (arch.vocab_size + h) * rank
    return (per_layer * arch.num_layers + embeddings) * loras * dtype_bytes


def check_speculative(raw: str | None) -> dict[str, Any] | None:
    """``--speculative-config`` as ``SpeculativeConfig`` takes it (``StartupError`` otherwise)."""
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError:
        raise StartupError("SystemExit", f"argument --speculative-config: Value {raw} cannot be converted") from None
    if not isinstance(cfg, dict):
        raise StartupError("ValueError", f"--speculative-config must be a JSON object, got {raw}")
    method = cfg.get("method")
    if method is None and cfg.get("model") is None:
        raise StartupError("ValueError", "num_speculative_tokens was provided but without speculative model.")
    if method is not None and method not in SPECULATIVE_METHODS:
        raise StartupError("ValueError", f"Input should be {', '.join(repr(m) for m in SPECULATIVE_METHODS)}")
    k = cfg.get("num_speculative_tokens")
    if not isinstance(k, int) or k <= 0:
        raise StartupError("ValueError", f"Expected num_speculative_tokens to be greater than zero ({k}).")
    if method == "ngram":
        low, high = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise StartupError("ValueError", f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        cfg = {**cfg, "prompt_lookup_min": low, "prompt_lookup_max": high}
    elif method in ("draft_model", "eagle", "eagle3") and not cfg.get("model"):
        raise StartupError("ValueError", f"method {method} needs a model in --speculative-config")
    return cfg

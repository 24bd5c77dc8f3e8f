"""Ask vLLM 0.33.0 itself: run in the oracle environment (vLLM + CPU-capable torch), never in fleet's.

Reads a JSON list of cases on stdin and writes one JSON answer per case on stdout. Each case
names a model directory (a ``config.json``), a TP size, a KV-cache dtype, a ``max_model_len``,
an available KV memory and ``max_num_batched_tokens``. The answers come from vLLM's own code:

* ``ModelConfig`` (``vllm/config/model.py``) reads the config through transformers, derives the
  default max length; ``_get_and_verify_max_len`` accepts or refuses a given length;
* ``ModelConfig.verify_with_parallel_config`` (heads % TP) and the KV-head split of
  ``QKVParallelLinear`` (``vllm.distributed.utils.divide``) decide TP validity;
  ``ModelConfig.get_num_kv_heads`` / ``get_head_size`` / ``use_mla`` give the per-GPU cache;
* per-layer ``FullAttentionSpec`` / ``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec`` /
  ``MLAAttentionSpec`` (``vllm/v1/kv_cache_interface.py``) are built the way vLLM's attention
  layers build them (layer kinds from transformers' ``layer_types`` / ``no_rope_layers``, as
  vLLM's model code reads them), then vLLM's ``get_kv_cache_groups``,
  ``get_kv_cache_configs`` and ``get_kv_cache_capacity`` group them, count blocks and tokens.

A case with ``"fp8_blocks": [major, minor]`` asks instead whether vLLM loads a block-quantized
FP8 checkpoint at that TP on a GPU of that compute capability, with vLLM's own functions: the
block size as ``Fp8Config.from_config`` reads it; ``validate_fp8_block_shape`` on each
row-parallel linear layer the model code builds (``o_proj``; ``down_proj`` of the dense MLP, or of
a Qwen-MoE shared expert: ``vllm/model_executor/models/qwen3.py``, ``qwen3_moe.py``); for the
routed experts ``refine_fp8_moe_block_shape``, else ``validate_fp8_block_shape_moe``, then which
fused-MoE kernels (``backend_to_kernel_cls`` of every ``Fp8MoeBackend``, standard activation
format) take the resulting block shape on that GPU (``_supports_current_device`` and
``_supports_quant_scheme``, with ``current_platform`` a CUDA platform of that capability whose
``supports_fp8`` is ``CudaPlatform``'s: capability ≥ 8.9). The layer list is the model code's, read
by hand: instantiating the model needs a GPU.

What is not vLLM's here: the per-layer kind comes from the transformers config the same way the
model classes read it (instantiating the model needs a GPU), and ``vllm_config`` is a real
``ModelConfig`` inside a small namespace carrying the scheduler/cache settings the planning
functions read (CUDA's defaults: KV layout LBNHC, async scheduling's two batches in flight,
the hybrid manager off only for chunked local attention).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from types import SimpleNamespace
from typing import Any


def _layer_specs(mc: Any, pc: Any, kv_dtype: str) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    dtype = mc.dtype if kv_dtype == "auto" else torch.uint8  # vLLM stores fp8 KV as uint8
    text = mc.hf_text_config
    layers = mc.get_total_num_hidden_layers()
    common = {"block_size": 16, "dtype": dtype}
    if mc.use_mla:
        return {
            f"layers.{i}.attn": MLAAttentionSpec(num_kv_heads=1, head_size=mc.get_head_size(), **common)
            for i in range(layers)
        }
    common |= {"num_kv_heads": mc.get_num_kv_heads(pc), "head_size": mc.get_head_size()}
    types = getattr(text, "layer_types", None)
    chunk = getattr(text, "attention_chunk_size", None)
    window = mc.get_sliding_window()
    specs: dict[str, Any] = {}
    for i in range(layers):
        if chunk and getattr(text, "no_rope_layers", None) is not None:
            kind = "chunked_attention" if text.no_rope_layers[i] else "full_attention"
        elif types is not None:
            kind = types[i]
        else:
            kind = "sliding_attention" if window else "full_attention"
        name = f"layers.{i}.attn"
        if kind == "sliding_attention":
            specs[name] = SlidingWindowSpec(sliding_window=text.sliding_window, **common)
        elif kind == "chunked_attention":
            specs[name] = ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **common)
        else:
            specs[name] = FullAttentionSpec(**common)
    return specs


_MODEL_CONFIGS: dict[str, Any] = {}


def model_config(model_dir: str) -> Any:
    """vLLM's ``ModelConfig`` of a model directory, built once per directory."""
    from vllm.config.model import ModelConfig

    if model_dir not in _MODEL_CONFIGS:
        _MODEL_CONFIGS[model_dir] = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="auto")
    return _MODEL_CONFIGS[model_dir]


def answer(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import ParallelConfig
    from vllm.config.model import _get_and_verify_max_len
    from vllm.distributed.utils import divide
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    mc = model_config(case["model_dir"])
    mc.max_model_len = mc.original_max_model_len = mc.get_and_verify_max_len(None)
    out: dict[str, Any] = {"default_max_model_len": mc.max_model_len}

    def accepts(length: int) -> bool:
        try:
            _get_and_verify_max_len(
                hf_config=mc.hf_text_config,
                model_arch_config=mc.model_arch_config,
                tokenizer_config=None,
                max_model_len=length,
                disable_sliding_window=False,
                sliding_window=mc.get_sliding_window(),
            )
        except ValueError:
            return False
        return True

    limit = case["fleet_limit"]
    out["accepts_fleet_limit"] = accepts(limit)
    out["accepts_fleet_limit_plus_one"] = accepts(limit + 1)
    tp = case["tp"]
    pc = ParallelConfig(tensor_parallel_size=tp)
    try:
        mc.verify_with_parallel_config(pc)
        total_kv = mc.get_total_num_kv_heads()
        if not mc.use_mla:
            divide(tp, total_kv) if tp >= total_kv else divide(total_kv, tp)
        out["tp_ok"] = True
    except (ValueError, AssertionError) as exc:
        out["tp_ok"] = False
        out["tp_error"] = str(exc)
        return out
    if case.get("tp_only"):
        return out
    specs = _layer_specs(mc, pc, case["kv_cache_dtype"])
    mc.max_model_len = case["max_model_len"]
    mc.original_max_model_len = case["max_model_len"]
    vc = _config(mc, pc, case["max_num_batched_tokens"])
    groups = planning.get_kv_cache_groups(vc, dict(specs))
    out["num_groups"] = len(groups)
    out["page_bytes"] = next(iter(specs.values())).page_size_bytes
    out["bytes_per_block"] = planning._pool_bytes_per_block(vc, groups)
    try:
        (config,) = planning.get_kv_cache_configs(vc, [specs], [case["available_memory"]], groups)
        tokens, concurrency = get_kv_cache_capacity(vc, config)
        out |= {"fits": True, "num_blocks": config.num_blocks, "kv_tokens": tokens, "max_concurrency": concurrency}
    except ValueError as exc:
        out |= {"fits": False, "error": str(exc).split(".")[0]}
    return out


def _config(mc: Any, pc: Any, max_num_batched_tokens: int) -> Any:
    """The parts of a ``VllmConfig`` vLLM's KV planning reads (CUDA's defaults), around a real ``ModelConfig``."""
    hybrid_off = getattr(mc.hf_text_config, "attention_chunk_size", None) is not None
    cache = SimpleNamespace(
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
        kv_cache_layout="LBNHC",
        get_resolved_kv_cache_layout=lambda: (
            __import__("vllm.v1.kv_cache_layout").v1.kv_cache_layout.KVCacheLayout.LBNHC
        ),
    )
    return SimpleNamespace(
        model_config=mc,
        parallel_config=pc,
        cache_config=cache,
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=hybrid_off, max_num_batched_tokens=max_num_batched_tokens
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        kv_transfer_config=None,
        max_in_flight_tokens=2 * max_num_batched_tokens,
        num_prefill_lookahead_tokens=0,
    )


def _cuda_platform(capability: tuple[int, int]) -> Any:
    """A CUDA platform of this compute capability (``vllm/platforms/cuda.py`` needs libcuda to import)."""
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class Cuda(Platform):
        _enum = PlatformEnum.CUDA

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def supports_fp8(cls) -> bool:  # CudaPlatform.supports_fp8
            return cls.has_device_capability(89)

    return Cuda()


def fp8_blocks(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's verdict on a block-quantized FP8 checkpoint at ``tp`` on GPUs of ``fp8_blocks`` capability."""
    import vllm.distributed
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        create_fp8_quant_key,
        kFp8Dynamic128Sym,
    )

    mc = model_config(case["model_dir"])
    block = Fp8Config.from_config(mc.hf_config.quantization_config).weight_block_size
    text, tp = mc.hf_text_config, case["tp"]
    hidden = text.hidden_size
    vllm.distributed.get_tensor_model_parallel_world_size = lambda: tp  # what the validators ask
    out: dict[str, Any] = {"block": block, "refused": None, "refined": None, "kernels": []}
    moe = getattr(text, "moe_intermediate_size", None) if getattr(text, "num_experts", 0) else None
    rows = [("o_proj", text.num_attention_heads * mc.get_head_size())]
    if moe is None:
        rows.append(("mlp.down_proj", text.intermediate_size))
    elif getattr(text, "shared_expert_intermediate_size", 0):
        rows.append(("shared_expert.down_proj", text.shared_expert_intermediate_size))
    for name, size in rows:  # RowParallelLinear: the input is split, the output is not
        try:
            fp8_utils.validate_fp8_block_shape(SimpleNamespace(tp_size=tp, prefix=name), size, hidden, size // tp,
                                               [hidden], block)  # fmt: skip
        except ValueError as exc:
            out["refused"] = str(exc)
            return out
    if moe is None:
        return out
    ispp = moe // tp
    moe_config = SimpleNamespace(intermediate_size_per_partition=ispp, tp_size=tp, hidden_dim=hidden)
    refined = moe_oracle.refine_fp8_moe_block_shape(moe_config, block)
    if refined is None:
        try:
            fp8_utils.validate_fp8_block_shape_moe(ispp, block)
        except ValueError as exc:
            out["refused"] = str(exc)
            return out
    out["refined"] = refined
    key = create_fp8_quant_key(static=True, group_shape=GroupShape(*(refined or block)))
    platform = _cuda_platform(tuple(case["fp8_blocks"]))
    for backend in moe_oracle.Fp8MoeBackend:
        try:
            kernels = moe_oracle.backend_to_kernel_cls(backend)
        except (ValueError, NotImplementedError, ImportError):
            continue  # NONE and the backends of other platforms
        for kernel in kernels:
            module = sys.modules[kernel.__module__]
            if hasattr(module, "current_platform"):
                module.current_platform = platform
            if (
                kernel.activation_format() == mk.FusedMoEActivationFormat.Standard
                and kernel._supports_current_device()
                and kernel._supports_quant_scheme(key, kFp8Dynamic128Sym)
            ):
                out["kernels"].append(kernel.__name__)
    if not out["kernels"]:  # select_fp8_moe_backend on CUDA
        out["refused"] = "No FP8 MoE backend supports the deployment configuration."
    return out


def pipeline(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM's answer for one instance over ``pp`` pipeline stages (multi-node, one stage per node).

    The layers of each stage from ``get_pp_indices`` (``vllm/distributed/utils.py``, with
    ``VLLM_PP_LAYER_PARTITION`` unset); each stage's KV specs are its layers' (as its workers
    register them); ``get_global_kv_cache_groups`` groups the whole model, ``get_kv_cache_configs``
    sizes every stage from its own available memory and gives all the smallest stage's block count;
    ``get_kv_cache_capacity`` gives the instance's tokens. Each stage alone (one worker) gives its
    own block count.
    """
    from vllm.config import ParallelConfig
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    mc = model_config(case["model_dir"])
    tp, pp = case["tp"], case["pp"]
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    mc.verify_with_parallel_config(pc)
    specs = _layer_specs(mc, pc, case["kv_cache_dtype"])
    layers = mc.get_total_num_hidden_layers()
    bounds = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    workers = [{f"layers.{i}.attn": specs[f"layers.{i}.attn"] for i in range(start, end)} for start, end in bounds]
    mc.max_model_len = mc.original_max_model_len = case["max_model_len"]
    vc = _config(mc, pc, case["max_num_batched_tokens"])
    groups = planning.get_global_kv_cache_groups(vc, workers)
    memory = case["available_memory"]
    own = [
        planning.get_kv_cache_configs(vc, [w], [m], groups)[0].num_blocks for w, m in zip(workers, memory, strict=True)
    ]
    configs = planning.get_kv_cache_configs(vc, workers, memory, groups)
    tokens, _ = get_kv_cache_capacity(vc, configs[0])
    return {"bounds": [list(b) for b in bounds], "own_blocks": own, "num_blocks": [c.num_blocks for c in configs],
            "kv_tokens": tokens}  # fmt: skip


def parses(case: dict[str, Any]) -> dict[str, Any]:
    """Whether vLLM's own ``vllm serve`` parser (``make_arg_parser``, ``vllm/entrypoints/common/cli_args.py``)
    accepts each argv, and the parallel settings it reads from it. Building the parser asks for the
    platform's device type: a CUDA platform stands in (``_cuda_platform``), as no GPU is here."""
    import vllm.platforms
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    platform = _cuda_platform((9, 0))
    type(platform).device_type = "cuda"
    type(platform).device_name = "cuda"
    vllm.platforms._current_platform = platform
    out = []
    for argv in case["argvs"]:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                ns = parser.parse_args(argv)
        except SystemExit:
            out.append({"ok": False, "error": said.getvalue().strip().splitlines()[-1:]})
            continue
        keys = ("nnodes", "node_rank", "master_addr", "master_port", "headless", "pipeline_parallel_size",
                "tensor_parallel_size", "distributed_executor_backend")  # fmt: skip
        out.append({"ok": True, **{k: getattr(ns, k) for k in keys}})
    return {"parsed": out}


def main() -> None:
    cases = json.load(sys.stdin)
    answers = []
    for case in cases:
        try:
            if "pp" in case:
                answers.append(pipeline(case))
            elif "argvs" in case:
                answers.append(parses(case))
            else:
                answers.append(fp8_blocks(case) if "fp8_blocks" in case else answer(case))
        except Exception as exc:  # report, so the test shows which model broke the oracle
            answers.append({"oracle_error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()

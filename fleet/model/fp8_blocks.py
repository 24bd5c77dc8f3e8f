"""vLLM 0.33's rules for block-quantized FP8 checkpoints under tensor parallelism.

A checkpoint whose ``quantization_config`` is ``quant_method: fp8`` with ``weight_block_size:
[block_n, block_k]`` (DeepSeek-V3, the Qwen3 ``-FP8`` releases) keeps one scale per block of
weights. Tensor parallelism cuts every weight into per-rank slices, and vLLM refuses to start
(when it builds the model) if a slice does not hold whole blocks, unless it can refine the scales:

* linear layers: ``Fp8LinearMethod.create_weights`` calls ``validate_fp8_block_shape``
  (``vllm/model_executor/layers/quantization/utils/fp8_utils.py``). A row-parallel layer needs its
  per-rank input divisible by ``block_k``: "Weight input_size_per_partition = N is not divisible
  by weight quantization block_k = K." The row-parallel layers of the models fleet plans are the
  attention's ``o_proj`` (input: heads × head_dim, MLA heads × v_head_dim), the dense MLP's
  ``down_proj`` (``intermediate_size``: dense models, and the leading dense layers of a MoE) and a
  Qwen-MoE shared expert's ``down_proj`` (``shared_expert_intermediate_size``,
  ``vllm/model_executor/models/qwen2_moe.py``/``qwen3_moe.py``). Merged column-parallel layers
  (QKV, gate_up) never refuse: ``ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch``
  (``layers/linear.py``) lets their partitions straddle blocks.
* routed experts: ``Fp8MoEMethod`` (``layers/quantization/fp8.py``) with each rank's slice of the
  expert MLP, ``moe_intermediate_size / TP``. When that is a multiple of ``block_n`` (and of
  ``block_k`` once TP > 1) nothing changes. Otherwise ``refine_fp8_moe_block_shape``
  (``layers/fused_moe/oracle/fp8.py``) refines the scales to g × g blocks, g = gcd(block_n,
  block_k, slice, hidden_size), when g ≥ 32; below that ``validate_fp8_block_shape_moe`` refuses:
  "The output_size of gate's and up's weight = N is not divisible by weight quantization block_n
  = B." (or, for ``block_k``, "The input_size of down's weight = N ...").
* a refined block shape has one kernel: Triton's fused MoE, which takes the block shape as an
  argument, on GPUs with native FP8 only (``TritonExperts._supports_quant_scheme``,
  ``layers/fused_moe/experts/triton_moe.py``; ``CudaPlatform.supports_fp8``: compute capability
  ≥ 8.9). Marlin, the FP8 kernel of older GPUs (A100, A10), takes 128 × 128 blocks only
  (``MarlinExperts._supports_quant_scheme``), so there ``select_fp8_moe_backend`` raises "No FP8
  MoE backend supports the deployment configuration."

So Qwen3-30B-A3B-FP8 (768-wide experts, 128 × 128 blocks) serves at TP 4 (slices of 192, scales
refined to 64 × 64) and TP 8 (96, refined to 32 × 32) on H100, H200, L40S, but not on A100; at
TP 16 (48: g = 16) nowhere. ``tests/oracle`` runs vLLM's own functions for these verdicts.

Not modelled (fleet never plans them, or they are out of this rule's reach): other checkpoint
formats (compressed-tensors, ModelOpt), MLA's non-merged column-parallel projections
(``q_b_proj``, ``kv_b_proj``), DeepSeek shared experts (``resolve_layer_fused_shared_expert``),
``ignored_layers`` (checked as if quantized: stricter than vLLM), ``--moe-backend`` and expert
parallelism (fleet sets neither).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.model.arch import ModelArch

#: ``refine_fp8_moe_block_shape``: a refined block smaller than this is not used.
MIN_REFINED_BLOCK = 32
#: ``CudaPlatform.supports_fp8``: ``has_device_capability(89)``.
NATIVE_FP8 = (8, 9)


@dataclass(frozen=True)
class Fp8Blocks:
    """What vLLM 0.33 does with a block-quantized FP8 checkpoint at one TP size."""

    problem: str | None = None  #: why vLLM refuses to start, in its words, with the numbers
    refined: tuple[int, int] | None = None  #: the experts' block scales, refined to fit the slice
    expert_slice: int = 0  #: moe_intermediate_size / TP

    def note(self, arch: ModelArch, tp: int) -> str | None:
        """What a plan should say about a refined block shape."""
        if self.refined is None or arch.quantization is None or arch.quantization.weight_block_size is None:
            return None
        bn, bk = arch.quantization.weight_block_size
        return (
            f"FP8 experts at TP {tp}: each rank holds {self.expert_slice} of {arch.expert_intermediate_size} "
            f"expert columns, not whole {bn}×{bk} blocks; vLLM refines the block scales to "
            f"{self.refined[0]}×{self.refined[1]} (refine_fp8_moe_block_shape) and serves them with Triton's "
            "fused-MoE kernel only, on GPUs with native FP8 (compute capability ≥ 8.9)"
        )


def _row_parallel(arch: ModelArch) -> list[tuple[str, int]]:
    """(layer, input size) of the row-parallel linear layers ``validate_fp8_block_shape`` checks."""
    heads_out = arch.num_attention_heads * (arch.v_head_dim if arch.is_mla else arch.head_dim)
    layers = [("o_proj", heads_out)]
    if not arch.is_moe or arch.dense_layers:
        layers.append(("mlp.down_proj", arch.intermediate_size))
    if arch.is_moe and arch.shared_expert_intermediate_size:
        layers.append(("shared_expert.down_proj", arch.shared_expert_intermediate_size))
    return layers


def fp8_blocks(arch: ModelArch, tp: int, compute_capability: tuple[int, int] | None) -> Fp8Blocks:
    """vLLM 0.33's verdict on a block-quantized FP8 checkpoint at TP ``tp`` on GPUs of this compute
    capability (None: not known; a refined shape is then allowed, and the plan says what it needs).

    Only meaningful for TP sizes ``ModelArch.tp_problem`` accepts (slices are whole numbers).
    """
    quant = arch.quantization
    if quant is None or quant.weight_block_size is None:
        return Fp8Blocks()
    bn, bk = quant.weight_block_size
    if tp > 1:
        for layer, size in _row_parallel(arch):
            if size % tp == 0 and (size // tp) % bk:
                return Fp8Blocks(
                    f"vLLM refuses the FP8 checkpoint at TP {tp}: Weight input_size_per_partition = {size // tp} "
                    f"is not divisible by weight quantization block_k = {bk} ({layer}: {size} / TP {tp}; "
                    f"weight_block_size [{bn}, {bk}])"
                )
    if not arch.is_moe:
        return Fp8Blocks()
    width = arch.expert_intermediate_size
    part = width // tp
    if part % bn == 0 and (tp == 1 or part % bk == 0):
        return Fp8Blocks(expert_slice=part)
    g = math.gcd(bn, bk, part, arch.hidden_size)
    if g < MIN_REFINED_BLOCK:
        what = (
            f"The output_size of gate's and up's weight = {part} is not divisible by weight quantization block_n = {bn}"
            if part % bn
            else f"The input_size of down's weight = {part} is not divisible by weight quantization block_k = {bk}"
        )
        return Fp8Blocks(
            f"vLLM refuses the FP8 checkpoint at TP {tp}: {what} (experts: {width} / TP {tp}; the block scales "
            f"cannot be refined either: gcd({bn}, {bk}, {part}, hidden {arch.hidden_size}) = {g} < "
            f"{MIN_REFINED_BLOCK})",
            expert_slice=part,
        )
    if compute_capability is not None and compute_capability < NATIVE_FP8:
        cc = ".".join(map(str, compute_capability))
        return Fp8Blocks(
            f"vLLM refuses the FP8 checkpoint at TP {tp} on these GPUs: No FP8 MoE backend supports the "
            f"deployment configuration (experts: {width} / TP {tp} = {part}, not whole {bn}×{bk} blocks; the "
            f"scales refined to {g}×{g} run only on Triton's fused-MoE kernel, which needs native FP8, compute "
            f"capability ≥ 8.9; these GPUs are {cc})",
            refined=(g, g),
            expert_slice=part,
        )
    return Fp8Blocks(refined=(g, g), expert_slice=part)

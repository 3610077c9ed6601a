"""open_clip's plain ViT CLIP as a transformers `CLIPModel` folder (`launch/export.py --format transformers` of the
`open_clip` method): the same network in transformers' names, its BPE tokenizer as `CLIPTokenizer` files and its
preprocessing as a `CLIPImageProcessor`.

The two implementations are the same network where open_clip's model config asks for nothing transformers'
CLIP lacks (`convertible`): a ViT image tower pooled at its class token with `ln_pre`, a text transformer pooled
at its end token (the largest id: transformers' legacy `eos_token_id` 2 pools at the argmax too), pre-norm blocks
without layer scale, LayerNorm eps 1e-5, GELU or QuickGELU. Attention's packed `in_proj` splits into q, k, v.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# open_clip config keys whose non-default values transformers' CLIP has no place for
UNSUPPORTED_VISION = ("timm_model_name", "attentional_pool", "no_ln_pre", "final_ln_after_pool", "ls_init_value")
UNSUPPORTED_TEXT = ("hf_model_name", "ls_init_value", "no_causal_mask", "final_ln_after_pool", "proj_bias")


def convertible(config: dict[str, Any]) -> str | None:
    """Why open_clip's model `config` has no CLIPModel twin (None: it has)."""
    vision, text = config.get("vision_cfg", {}), config.get("text_cfg", {})
    reasons = [f"vision_cfg.{key}" for key in UNSUPPORTED_VISION if vision.get(key)]
    reasons += [f"text_cfg.{key}" for key in UNSUPPORTED_TEXT if text.get(key)]
    if isinstance(vision.get("layers"), (list, tuple)):
        reasons.append("a ResNet image tower")
    if vision.get("pool_type", "tok") != "tok" or vision.get("global_average_pool"):
        reasons.append("image features not pooled at the class token")
    if text.get("pool_type", "argmax") != "argmax" or text.get("embed_cls"):
        reasons.append("text features not pooled at the end token")
    if config.get("custom_text") or config.get("init_logit_bias") is not None:
        reasons.append("a custom text tower or a logit bias (SigLIP-style)")
    return f"transformers' CLIPModel has no place for {', '.join(reasons)}" if reasons else None


def clip_config(clip: Any, config: dict[str, Any], quick_gelu: bool, image_size: int) -> Any:
    from transformers import CLIPConfig

    visual, width = clip.visual, int(clip.token_embedding.weight.shape[1])
    act = "quick_gelu" if quick_gelu else "gelu"
    text = {
        "vocab_size": int(clip.vocab_size),
        "hidden_size": width,
        "intermediate_size": int(clip.transformer.resblocks[0].mlp.c_fc.weight.shape[0]),
        "num_hidden_layers": len(clip.transformer.resblocks),
        "num_attention_heads": int(clip.transformer.resblocks[0].attn.num_heads),
        "max_position_embeddings": int(clip.context_length),
        "hidden_act": act,
        "eos_token_id": 2,  # transformers' legacy rule: pool at the largest id, as open_clip does
    }
    vision_width = int(visual.conv1.weight.shape[0])
    vision = {
        "hidden_size": vision_width,
        "intermediate_size": int(visual.transformer.resblocks[0].mlp.c_fc.weight.shape[0]),
        "num_hidden_layers": len(visual.transformer.resblocks),
        "num_attention_heads": int(visual.transformer.resblocks[0].attn.num_heads),
        "image_size": image_size,
        "patch_size": int(visual.conv1.weight.shape[-1]),
        "hidden_act": act,
    }
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=int(config["embed_dim"]))


def _blocks(state: dict[str, torch.Tensor], source: str, target: str, layers: int) -> dict[str, torch.Tensor]:
    names = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    names["attn.out_proj"] = "self_attn.out_proj"
    out = {}
    for i in range(layers):
        ours, theirs = f"{source}.{i}.", f"{target}.{i}."
        for kind in ("weight", "bias"):
            for a, b in names.items():
                out[f"{theirs}{b}.{kind}"] = state[f"{ours}{a}.{kind}"]
            out |= split_qkv(state[f"{ours}attn.in_proj_{kind}"], theirs, kind)
    return out


def split_qkv(packed: torch.Tensor, layer: str, kind: str) -> dict[str, torch.Tensor]:
    """A packed q, k, v projection's `kind` (weight or bias) as transformers' CLIP layer `layer` names them."""
    return {f"{layer}self_attn.{part}_proj.{kind}": t for part, t in zip(("q", "k", "v"), packed.chunk(3))}


def clip_state(state: dict[str, torch.Tensor], text_layers: int, vision_layers: int) -> dict[str, torch.Tensor]:
    """open_clip's CLIP state dict in `CLIPModel`'s names."""
    out = {
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        "logit_scale": state["logit_scale"].reshape(()),
    }
    out |= _blocks(state, "transformer.resblocks", "text_model.encoder.layers", text_layers)
    out |= _blocks(state, "visual.transformer.resblocks", "vision_model.encoder.layers", vision_layers)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """open_clip's BPE (`SimpleTokenizer`: its vocabulary and merge ranks) as `CLIPTokenizer`'s files."""
    from transformers import CLIPTokenizer

    bpe = tokenizer.tokenizer if hasattr(tokenizer, "tokenizer") else tokenizer
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}  # transformers' spelling
    vocab = {names.get(token, token): index for token, index in bpe.encoder.items()}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get)
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    files = str(out / "vocab.json"), str(out / "merges.txt")
    CLIPTokenizer(*files, model_max_length=int(tokenizer.context_length)).save_pretrained(out)


def write_clip_model(
    clip: Any, config: dict[str, Any], quick_gelu: bool, preprocess: dict[str, Any], out: Path
) -> None:
    """`clip` (open_clip's CLIP, fp32) as a `CLIPModel` folder with its tokenizer and image processor."""
    from transformers import CLIPModel

    size = preprocess["image_size"]
    size = size if isinstance(size, int) else size[0]
    hf_config = clip_config(clip, config, quick_gelu, size)
    layers = hf_config.text_config.num_hidden_layers, hf_config.vision_config.num_hidden_layers
    model = CLIPModel(hf_config)
    model.load_state_dict(clip_state(clip.state_dict(), *layers))
    model.save_pretrained(out)
    write_crop_processor(size, preprocess["mean"], preprocess["std"], out)


def write_crop_processor(size: int, mean: Any, std: Any, out: Path) -> None:
    """open_clip's evaluation preprocessing (shortest side to `size`, bicubic, centre crop, normalised) as a
    `CLIPImageProcessor` in `out`."""
    from transformers import CLIPImageProcessor

    square = {"height": size, "width": size}
    processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size=square, image_mean=list(mean), image_std=list(std)
    )
    processor.save_pretrained(out)

"""The `clip` method's model as a transformers `ChineseCLIPModel` folder (`launch/export.py --format transformers`):
a timm ViT image tower in CLIP's layout and a BERT text tower pooled at its first ([CLS]) token, which is
Chinese-CLIP's network.

transformers' Chinese-CLIP vision tower is CLIP's: patch embedding without bias, class token, absolute positions,
a LayerNorm before the blocks (timm's `pre_norm`), pre-norm blocks with separate q, k, v projections (timm's
packed `qkv` splits into them), GELU or QuickGELU, and the final LayerNorm applied to the class token.
`vision_problem` and `text_problem` name what a run's towers have that this layout cannot hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.models.open_clip_to_clip_model import split_qkv, write_crop_processor

ACTIVATIONS = {"GELU": "gelu", "QuickGELU": "quick_gelu"}  # timm's Mlp activations CLIP's config names


def vision_problem(visual: nn.Module) -> str | None:
    """Why the timm network `visual` has no place in Chinese-CLIP's (CLIP's) vision tower (None: it has)."""
    from timm.models.vision_transformer import Block, VisionTransformer

    if not isinstance(visual, VisionTransformer):
        return f"a {type(visual).__name__} image tower (it holds a ViT)"
    v: Any = visual
    checks = {
        "a LayerNorm before the blocks (timm_kwargs pre_norm: true)": isinstance(v.norm_pre, nn.LayerNorm),
        "a class token and no register tokens": v.cls_token is not None and v.num_prefix_tokens == 1,
        "features pooled at the class token": v.global_pool == "token" and v.attn_pool is None,
        "no norm after pooling": isinstance(v.fc_norm, nn.Identity),
        "positions for the class token": not v.no_embed_class and not v.dynamic_img_size,
        "a patch embedding without bias": v.patch_embed.proj.bias is None,
    }
    eps = {m.eps for m in v.modules() if isinstance(m, nn.LayerNorm)}
    checks["one LayerNorm eps"] = len(eps) == 1
    blocks: list[Any] = list(v.blocks)
    checks["plain pre-norm blocks (no layer scale, no q/k norm, q/k/v biases)"] = all(
        b.__class__ is Block  # timm subclasses (parallel, residual-scaled blocks) differ
        and all(isinstance(m, nn.Identity) for m in (b.ls1, b.ls2, b.attn.q_norm, b.attn.k_norm, b.attn.norm))
        and b.attn.qkv.bias is not None
        and isinstance(getattr(b.mlp, "norm", nn.Identity()), nn.Identity)
        for b in blocks
    )
    activations = {_activation(b) for b in blocks}
    checks["one activation, GELU or QuickGELU"] = len(activations) == 1 and None not in activations
    missing = [what for what, ok in checks.items() if not ok]
    return f"an image tower without {', '.join(missing)}" if missing else None


def _activation(block: Any) -> str | None:
    act = getattr(block.mlp, "act", None)
    if isinstance(act, nn.GELU) and act.approximate != "none":
        return None
    return ACTIVATIONS.get(type(act).__name__)


def text_problem(config: Any, pooling: str) -> str | None:
    """Why a text tower of transformers config `config`, pooled so, has no place in Chinese-CLIP's (None: it has)."""
    if pooling != "cls":
        return "text features mean-pooled (ChineseCLIPModel's are the [CLS] token's: method.text.pooling: cls)"
    if config.model_type != "bert" or getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"a {config.model_type} text tower (it holds a BERT)"
    return None


def chinese_clip_config(model: Any, image_size: int) -> Any:
    from transformers import ChineseCLIPConfig

    v: Any = model.visual
    bert = model.text.config
    text_keys = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
        "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "pad_token_id",
    )  # fmt: skip
    vision = {
        "hidden_size": int(v.embed_dim),
        "intermediate_size": int(v.blocks[0].mlp.fc1.out_features),
        "num_hidden_layers": len(v.blocks),
        "num_attention_heads": int(v.blocks[0].attn.num_heads),
        "image_size": image_size,
        "patch_size": int(v.patch_embed.proj.kernel_size[0]),
        "hidden_act": _activation(v.blocks[0]),
        "layer_norm_eps": float(v.norm.eps),
    }
    return ChineseCLIPConfig(
        text_config={key: getattr(bert, key) for key in text_keys},
        vision_config=vision,
        projection_dim=int(model.image_projection.out_features),
    )


def chinese_clip_state(model: Any) -> dict[str, torch.Tensor]:
    """The `clip` model's tensors in `ChineseCLIPModel`'s names."""
    state = model.state_dict()
    out = {f"text_model.{key[len('text.') :]}": value for key, value in state.items() if key.startswith("text.")}
    vision = {
        "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
        "norm_pre.weight": "pre_layrnorm.weight",
        "norm_pre.bias": "pre_layrnorm.bias",
        "norm.weight": "post_layernorm.weight",
        "norm.bias": "post_layernorm.bias",
    }
    for ours, theirs in vision.items():
        out[f"vision_model.{theirs}"] = state[f"visual.{ours}"]
    out["vision_model.embeddings.class_embedding"] = state["visual.cls_token"].reshape(-1)
    out["vision_model.embeddings.position_embedding.weight"] = state["visual.pos_embed"][0]
    names = {"norm1": "layer_norm1", "norm2": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    names["attn.proj"] = "self_attn.out_proj"
    for i in range(len(model.visual.blocks)):
        ours, theirs = f"visual.blocks.{i}.", f"vision_model.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            for a, b in names.items():
                out[f"{theirs}{b}.{kind}"] = state[f"{ours}{a}.{kind}"]
            out |= split_qkv(state[f"{ours}attn.qkv.{kind}"], theirs, kind)
    out["visual_projection.weight"] = state["image_projection.weight"]
    out["text_projection.weight"] = state["text_projection.weight"]
    out["logit_scale"] = state["logit_scale"].reshape(())
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def write_chinese_clip_model(model: Any, preprocess: dict[str, Any], out: Path) -> None:
    """`model` (the `clip` method's, fp32) as a `ChineseCLIPModel` folder with a `CLIPImageProcessor` doing its
    evaluation preprocessing (shortest side to the size, bicubic, centre crop)."""
    from transformers import ChineseCLIPModel

    size = int(preprocess["size"])
    folder = ChineseCLIPModel(chinese_clip_config(model, size))
    folder.load_state_dict(chinese_clip_state(model))
    folder.save_pretrained(out)
    write_crop_processor(size, preprocess["mean"], preprocess["std"], out)

"""`--format open_clip`: a model config and a state dict that open_clip loads as they are.

The folder holds `<name>.json` (the model config, registered with `open_clip.add_model_config`),
`open_clip_model.safetensors` (open_clip's parameter names), `open_clip_config.json` (the same model
config with its preprocessing, for `open_clip.create_model_and_transforms("local-dir:<folder>")`)
and, for a `clip` model, the text tower's Hugging Face config and tokenizer.

- An `open_clip` model is open_clip's own network: its parameters are renamed back (`clip.` dropped,
  `logit_scale` 0-D again) and its model config is written out, the forced image size applied.
- A `clip` model is one open_clip builds with its timm image adapter (`timm_model_name`, the timm
  network's own pooling, a bias-free linear projection) and its Hugging Face text adapter (`hf_model_name`:
  a BERT built from `config.json` in this folder, mean pooling over non-padding tokens, a bias-free linear
  projection). open_clip reads the padding from `pad_token_id`, mmpt from the tokenizer's mask: the same
  positions, since the tokenizer pads with that id. `hf_model_name` is this folder's absolute path: after
  moving the folder, edit it in both JSON files (or export again).

After writing, the folder is loaded with open_clip and its image and text features compared with mmpt's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from mmpt.export.card import (
    CARD,
    mmpt_usage,
    open_clip_lines,
    open_clip_name,
    open_clip_preprocess,
    parameter_counts,
    render,
    training_record,
)
from mmpt.export.towers import towers
from mmpt.release import PretrainedModel

if TYPE_CHECKING:
    from mmpt.data.tokenizer import TextTokenizer
    from mmpt.methods.clip import ClipConfig
    from mmpt.methods.open_clip import OpenClipConfig
    from mmpt.models.clip import ClipModel

WEIGHTS = "open_clip_model.safetensors"
LOCAL_CONFIG = "open_clip_config.json"
TOLERANCE = 1e-5


def clip_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `clip` model's parameters under open_clip's names (CustomTextCLIP with TimmModel and HFTextEncoder)."""
    renamed = {}
    for key, value in state.items():
        if key.startswith("visual."):
            renamed["visual.trunk." + key[len("visual.") :]] = value
        elif key == "image_projection.weight":
            renamed["visual.head.proj.weight"] = value
        elif key.startswith("text."):
            renamed["text.transformer." + key[len("text.") :]] = value
        elif key == "text_projection.weight":
            renamed["text.proj.weight"] = value
        elif key == "logit_scale":
            renamed[key] = value.reshape(())
        else:
            raise KeyError(f"{key}: no open_clip counterpart known for this clip parameter")
    return renamed


def clip_model_config(model: PretrainedModel, out: Path) -> dict[str, Any]:
    """open_clip's model config of a `clip` model; writes the text tower's Hugging Face config and tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from mmpt.export.formats import OPEN_CLIP_TIMM_KWARGS

    m = cast("ClipConfig", model.config.method)
    tokenizer = cast("TextTokenizer", model.preprocessors()["tokenizer"])
    pad_id = tokenizer._tokenizer.padding["pad_id"] if tokenizer._tokenizer.padding else 0
    text_config = copy.deepcopy(cast("ClipModel", model.model).text.config)
    text_config.pad_token_id = pad_id  # open_clip's HFTextEncoder masks the positions holding this id
    text_config.save_pretrained(out)
    vocab = tokenizer._tokenizer.get_vocab()
    specials = {
        key: token
        for key, token in (
            ("unk_token", "[UNK]"),
            ("cls_token", "[CLS]"),
            ("sep_token", "[SEP]"),
            ("mask_token", "[MASK]"),
        )
        if token in vocab
    }
    fast = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer.path,
        pad_token=tokenizer._tokenizer.id_to_token(pad_id),
        model_max_length=tokenizer.context_length,
        **specials,
    )
    fast.save_pretrained(out)
    folder = str(out.resolve())
    vision: dict[str, Any] = {
        "image_size": m.image.image_size,
        "timm_model_name": m.image.timm_name,
        "timm_model_pretrained": False,
        "timm_pool": "",  # the timm network's own pooling, as mmpt builds it
        "timm_proj": "linear",
        "timm_proj_bias": False,
    }
    for key, value in m.image.timm_kwargs.items():
        vision[OPEN_CLIP_TIMM_KWARGS[key]] = value
    return {
        "embed_dim": m.embed_dim,
        "vision_cfg": vision,
        "text_cfg": {
            "hf_model_name": folder,
            "hf_tokenizer_name": folder,
            "hf_model_pretrained": False,
            "hf_proj_type": "linear",
            "hf_pooler_type": "mean_pooler",
            "context_length": tokenizer.context_length,
        },
    }


def open_clip_model_config(model: PretrainedModel, out: Path) -> dict[str, Any]:
    """The model config of an `open_clip` model (its forced image size applied); saves an HF tokenizer it names."""
    import open_clip

    from mmpt.models.open_clip_model import register_model_config

    m = cast("OpenClipConfig", model.config.method)
    name = register_model_config(m.model)
    config: dict[str, Any] = copy.deepcopy(open_clip.get_model_config(name) or {})
    if m.image_size:
        config["vision_cfg"]["image_size"] = m.image_size
    if config.get("text_cfg", {}).get("hf_tokenizer_name"):
        tokenizer: Any = open_clip.get_tokenizer(name)  # an HFTokenizer: local-dir: reads it from the folder
        tokenizer.save_pretrained(str(out))
    return config


def features(model: Any, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None):
    with torch.no_grad():
        text = model.encode_text(ids, mask) if mask is not None else model.encode_text(ids)
        return model.encode_image(images), text


def check_folder(model: PretrainedModel, out: Path) -> float:
    """Load the folder with open_clip and compare its features with mmpt's; RuntimeError past TOLERANCE."""
    import open_clip

    loaded: Any = open_clip.create_model(f"local-dir:{out}").eval()
    image_tower, text_tower = towers(model.model, model.config)
    images = image_tower.example(2)[0]
    ids, *mask = text_tower.example(2)
    if mask:  # open_clip derives the mask from the padding id: put that id where mmpt's mask says padding
        pad_id = loaded.text.config.pad_token_id
        ids = ids.masked_fill(ids == pad_id, pad_id + 1).masked_fill(mask[0] == 0, pad_id)
    ours = features(model.model, images, ids, mask[0] if mask else None)
    with torch.no_grad():
        theirs = loaded.encode_image(images, normalize=True), loaded.encode_text(ids, normalize=True)
    error = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    if not error <= TOLERANCE:
        raise RuntimeError(f"{out}: open_clip's features differ from mmpt's by {error:.2e} (more than {TOLERANCE:g})")
    return error


def export_open_clip(model: PretrainedModel, out: Path, check: bool = True) -> Path:
    """Write `model` (a `clip` or `open_clip` model, checked by `formats.check_export`) as an open_clip folder."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model = model.float().eval()
    state = {k: v.detach().cpu() for k, v in model.model.state_dict().items()}
    if model.config.method_name == "clip":
        config = clip_model_config(model, out)
        state = clip_state(state)
    else:
        config = open_clip_model_config(model, out)
        state = {k[len("clip.") :]: (v.reshape(()) if k == "clip.logit_scale" else v) for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
    name = open_clip_name(out)
    (out / f"{name}.json").write_text(json.dumps(config, indent=2) + "\n")
    preprocess = open_clip_preprocess(model.config)
    local = {"model_cfg": config, "preprocess_cfg": preprocess}
    (out / LOCAL_CONFIG).write_text(json.dumps(local, indent=2) + "\n")
    if check:
        check_folder(model, out)
    (out / CARD).write_text(open_clip_card(model, out, name), encoding="utf-8")
    return out


def open_clip_card(model: PretrainedModel, out: Path, name: str) -> str:
    cfg = model.config
    folder = str(out)
    usage = [
        "## How to use it",
        "",
        "### With open_clip",
        "",
        "```python",
        *open_clip_lines(folder, cfg),
        "```",
        "",
        "or, with the preprocessing read from `open_clip_config.json`:",
        "",
        "```python",
        "import open_clip",
        f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{folder}")',
        f'tokenizer = open_clip.get_tokenizer("local-dir:{folder}")',
        "```",
        "",
        "`model.encode_image(preprocess(image).unsqueeze(0))` and `model.encode_text(tokenizer(texts))` give "
        "mmpt's features (`normalize=True` for L2-normalised ones).",
    ]
    if cfg.method_name == "clip":
        usage += [
            "",
            "The text tower is open_clip's Hugging Face adapter over the BERT in `config.json`; "
            f"`hf_model_name` and `hf_tokenizer_name` in `{name}.json` and `{LOCAL_CONFIG}` name this folder by "
            "its absolute path: edit both after moving it.",
        ]
    usage += ["", "### With mmpt", "", mmpt_usage(cfg, str(model.files_from))]
    files = [
        (f"{name}.json", f"open_clip model config (`open_clip.add_model_config`, model name `{name}`)"),
        (WEIGHTS, "the state dict, open_clip's parameter names"),
        (LOCAL_CONFIG, "model config and preprocessing for `local-dir:`"),
    ]
    if cfg.method_name == "clip":
        files += [
            ("config.json", "the BERT text tower's Hugging Face config"),
            ("tokenizer.json, tokenizer_config.json", "the tokenizer (Hugging Face fast tokenizer files)"),
        ]
    files.append((CARD, "this card"))
    return render(
        cfg,
        title=f"{out.resolve().name}: an mmpt `{cfg.method_name}` model for open_clip",
        kind="open_clip",
        parameters=parameter_counts(cfg, model.files_from, model.model.state_dict()),
        record=training_record(model.files_from),
        usage="\n".join(usage),
        files=files,
        files_from=model.files_from,
    )

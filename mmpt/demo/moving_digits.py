"""The bilingual moving-digits video corpus: short mp4 clips of scikit-learn's handwritten digit scans.

Two kinds of clip, rendered on a black canvas from the 8x8 scans (upscaled):
- `move`: one digit crosses the frame in one of eight directions (left, right, up, down and the diagonals);
- `order`: two different digits appear one after the other, at random sides, and both stay. Which one came
  first is visible only over time: the last frame shows both, so a single frame cannot tell the order.

Every clip has several English and Chinese captions from paraphrase templates ("the digit seven moves to the
left." / "数字七向左移动。", "first a three appears, then a five." / "先出现数字三，然后出现数字五。").
Layout under the root:

    train/en-NNNNNN.tar, train/zh-NNNNNN.tar   `mp4` + `json` ({"sentences": [...], "kind", "digits", "scans", ...})
    test/test-NNNNNN.tar                       `mp4` + `json` (English) + `zh.json` (Chinese)
    test/videos/<key>.mp4                      the same held-out clips as files
    test/retrieval_{en,zh}.jsonl               {"video": "videos/<key>.mp4", "caption": [...]} per clip
    test/msrvtt_{en,zh}.csv                    `video_id,sentence`, one caption per clip (MSR-VTT 1k-A style)
    tokenizer.json                             a WordPiece vocabulary of all captions
    COMPLETE                                   written last

Held-out clips are rendered from held-out scans (a stratified 20% of every digit) and captioned with
held-out templates; by default the test set holds every (digit, direction) and (first, second) combination
once, so every test caption names exactly one clip. Nothing is downloaded. Deterministic: seeded RNGs, and
the encoder runs single-threaded with bit-exact muxing, so rebuilds with the same PyAV/FFmpeg are
byte-identical.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np

from mmpt.data.shards import ShardSetWriter
from mmpt.data.tokenizer import train_wordpiece
from mmpt.demo import register
from mmpt.demo.corpus import fresh_staging, is_built, mark_complete, publish
from mmpt.demo.digits import NAMES, drawn_digit

LANGUAGES = ("en", "zh")
KINDS = ("move", "order")
# Direction -> (dx, dy), image coordinates (y grows downwards).
DIRECTIONS = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
    "up_left": (-1, -1),
    "up_right": (1, -1),
    "down_left": (-1, 1),
    "down_right": (1, 1),
}
# Per direction and language: (towards, where it starts, where it ends).
DIRECTION_WORDS = {
    "en": {
        "left": ("to the left", "the right", "the left"),
        "right": ("to the right", "the left", "the right"),
        "up": ("upwards", "the bottom", "the top"),
        "down": ("downwards", "the top", "the bottom"),
        "up_left": ("to the upper left", "the lower right", "the upper left"),
        "up_right": ("to the upper right", "the lower left", "the upper right"),
        "down_left": ("to the lower left", "the upper right", "the lower left"),
        "down_right": ("to the lower right", "the upper left", "the lower right"),
    },
    "zh": {
        "left": ("向左", "右边", "左边"),
        "right": ("向右", "左边", "右边"),
        "up": ("向上", "下边", "上边"),
        "down": ("向下", "上边", "下边"),
        "up_left": ("向左上方", "右下方", "左上方"),
        "up_right": ("向右上方", "左下方", "右上方"),
        "down_left": ("向左下方", "右上方", "左下方"),
        "down_right": ("向右下方", "左上方", "右下方"),
    },
}
# move: {w} word, {aw} word with its article, {n} numeral, {to}/{src}/{dst} from DIRECTION_WORDS.
# order: {a}/{b} words, {aa}/{ab} with articles, {na}/{nb} numerals; a appears first.
TRAIN_TEMPLATES = {
    ("move", "en"): [
        "the digit {w} moves {to}.",
        "{aw} slides {to}.",
        "the number {n} travels {to} across the screen.",
        "{aw} moves from {src} to {dst}.",
        "a handwritten {w} drifts {to} on a black background.",
        "the digit {n} goes {to}.",
        "a white {w} glides from {src} to {dst}.",
    ],
    ("move", "zh"): [
        "数字{w}{to}移动。",
        "一个{w}{to}滑动。",
        "数字{n}{to}穿过画面。",
        "一个{w}从{src}移到{dst}。",
        "黑色背景上，手写的{w}{to}飘动。",
        "数字{n}{to}运动。",
        "白色的{w}从{src}滑到{dst}。",
    ],
    ("order", "en"): [
        "first {aa} appears, then {ab}.",
        "the digit {a} appears first, followed by the digit {b}.",
        "{aa} shows up before {ab}.",
        "{ab} appears after {aa}.",
        "first the number {na}, then the number {nb}.",
        "the digit {a} appears, and then the digit {b} joins it.",
    ],
    ("order", "zh"): [
        "先出现数字{a}，然后出现数字{b}。",
        "数字{a}先出现，接着出现数字{b}。",
        "{a}在{b}之前出现。",
        "{b}在{a}之后出现。",
        "先是数字{na}，然后是数字{nb}。",
        "数字{a}出现后，数字{b}也出现了。",
    ],
}
EVAL_TEMPLATES = {
    ("move", "en"): ["{aw} is moving {to}.", "the handwritten digit {w} moves from {src} to {dst}."],
    ("move", "zh"): ["一个{w}正在{to}移动。", "手写数字{w}从{src}移动到{dst}。"],
    ("order", "en"): ["first the digit {a} appears, then the digit {b}.", "{ab} appears right after {aa}."],
    ("order", "zh"): ["先出现的是数字{a}，后出现的是数字{b}。", "数字{a}出现之后，紧接着出现数字{b}。"],
}


def _with_article(word: str) -> str:
    return f"{'an' if word == 'eight' else 'a'} {word}"


def caption(template: str, language: str, clip: dict) -> str:
    names = NAMES[language]
    if clip["kind"] == "move":
        (digit,) = clip["digits"]
        to, src, dst = DIRECTION_WORDS[language][clip["direction"]]
        word = names[digit]
        return template.format(w=word, aw=_with_article(word), n=digit, to=to, src=src, dst=dst)
    first, second = clip["digits"]
    a, b = names[first], names[second]
    return template.format(a=a, b=b, aa=_with_article(a), ab=_with_article(b), na=first, nb=second)


def _split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per digit, the scan indices kept for training and held out (a stratified split)."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for label in range(10):
        members = rng.permutation(np.flatnonzero(labels == label)).tolist()
        cut = max(1, round(len(members) * test_fraction))
        test[label], train[label] = sorted(members[:cut]), sorted(members[cut:])
    return train, test


def _combos(kind: str) -> list[tuple]:
    if kind == "move":
        return [(digit, direction) for digit in range(10) for direction in DIRECTIONS]
    return [(first, second) for first in range(10) for second in range(10) if first != second]


def _render(clip: dict, scans: list[np.ndarray], frames: int, size: int, rng: random.Random) -> np.ndarray:
    """Grey frames [T, size, size] uint8 of one clip; `scans` are the digits' 8x8 images, in clip order."""
    glyph_size = size * 3 // 8
    glyphs = [np.asarray(drawn_digit(scan, glyph_size), np.float32) * rng.uniform(0.75, 1.0) for scan in scans]
    lo, hi = 1, size - glyph_size - 1  # top-left corner range that keeps the glyph inside the frame
    canvas = np.zeros((frames, size, size), dtype=np.float32)

    def paste(t: int, glyph: np.ndarray, x: int, y: int) -> None:
        window = canvas[t, y : y + glyph_size, x : x + glyph_size]
        np.maximum(window, glyph, out=window)

    if clip["kind"] == "move":
        dx, dy = DIRECTIONS[clip["direction"]]
        span = hi - lo
        paths = []
        for step in (dx, dy):
            if step == 0:
                position = rng.randint(lo, hi)
                paths.append([position] * frames)
                continue
            length = rng.uniform(0.7, 1.0) * span
            start = lo + rng.uniform(0.0, span - length)
            points = [start + length * t / max(1, frames - 1) for t in range(frames)]
            paths.append([round(p) for p in (points if step > 0 else points[::-1])])
        for t in range(frames):
            paste(t, glyphs[0], paths[0][t], paths[1][t])
    else:
        half = size // 2
        sides = [0, 1] if rng.random() < 0.5 else [1, 0]  # which half the first digit takes
        appear = [rng.randint(0, frames // 4), rng.randint(frames // 2 - 1, 3 * frames // 4)]
        for glyph, side, start in zip(glyphs, sides, appear):
            x = rng.randint(lo + side * half, max(lo + side * half, min(hi, lo + side * half + half - glyph_size)))
            y = rng.randint(lo, hi)
            for t in range(start, frames):
                paste(t, glyph, x, y)
    return canvas.clip(0, 255).astype(np.uint8)


def _video_codec() -> str:
    import av

    for name in ("libx264", "libopenh264", "mpeg4"):
        try:
            av.Codec(name, "w")
        except Exception:
            continue
        return name
    raise RuntimeError("PyAV has neither an h264 nor an mpeg4 encoder")


def _yuv420p(frame: np.ndarray) -> np.ndarray:
    """Grey [H, W] or RGB [H, W, 3] uint8 -> planar yuv420p [H * 3 / 2, W] (BT.601, limited range).

    Converted here rather than by FFmpeg's swscale, so the pixels the encoder sees do not depend on which
    conversion paths the installed FFmpeg build takes.
    """
    pixels = frame.astype(np.float32)
    if pixels.ndim == 2:
        y = 16.0 + pixels * (219.0 / 255.0)
        u = v = np.full((pixels.shape[0] // 2, pixels.shape[1] // 2), 128.0, dtype=np.float32)
    else:
        r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
        y = 16.0 + (65.481 * r + 128.553 * g + 24.966 * b) / 255.0
        height, width = y.shape

        def half(plane: np.ndarray) -> np.ndarray:
            return plane.reshape(height // 2, 2, width // 2, 2).mean(axis=(1, 3))

        u = half(128.0 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255.0)
        v = half(128.0 + (112.0 * r - 93.786 * g - 18.214 * b) / 255.0)
    planes = [np.rint(plane).clip(0, 255).astype(np.uint8).ravel() for plane in (y, u, v)]
    return np.concatenate(planes).reshape(frame.shape[0] * 3 // 2, frame.shape[1])


def encode_mp4(frames: np.ndarray, fps: int = 8, codec: str | None = None) -> bytes:
    """Grey [T, H, W] or RGB [T, H, W, 3] uint8 frames -> mp4 bytes (yuv420p; single-threaded, bit-exact muxing)."""
    import av
    from av.codec.context import Flags

    codec = codec or _video_codec()
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {width}x{height}")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        # libx264's macroblock-tree rate control (assembly path) reads uninitialised memory: with it on, the
        # same frames encode to different bytes from run to run. Off, and on one thread, encoding is repeatable.
        options = {"threads": "1", "x264-params": "mbtree=0"} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=fps, options=options)
        assert isinstance(stream, av.VideoStream)  # a video codec's stream
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.flags |= Flags.bitexact
        for index, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(_yuv420p(frame), format="yuv420p")
            picture.pts = index
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    return buffer.getvalue()


def _plan(kind: str, count: int, rng: random.Random, exhaustive: bool) -> list[dict]:
    """`count` clips of a kind, cycling through its combinations in shuffled order (every one once first)."""
    combos = _combos(kind)
    order = list(range(len(combos)))
    clips = []
    while len(clips) < count:
        rng.shuffle(order)
        for i in order[: count - len(clips)]:
            if kind == "move":
                clips.append({"kind": kind, "digits": [combos[i][0]], "direction": combos[i][1]})
            else:
                clips.append({"kind": kind, "digits": list(combos[i])})
        if exhaustive:
            break
    return clips


@register("moving_digits")
def build_moving_digits(
    root: str | os.PathLike,
    *,
    frames: int = 16,
    size: int = 64,
    fps: int = 8,
    clips_per_kind: int = 800,
    test_clips_per_kind: int | None = None,
    sentences_per_clip: int = 3,
    shard_size: int = 200,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Path:
    """Build the corpus at `root` unless already complete; safe when several ranks race to build it.

    `test_clips_per_kind=None` holds out every combination once (80 `move` + 90 `order` = 170 clips).
    """
    from sklearn.datasets import load_digits

    if frames < 4:
        raise ValueError(f"clips need at least 4 frames to show motion and order, got {frames}")
    root = Path(root)
    if is_built(root):
        return root
    staging = fresh_staging(root)
    digits: Any = load_digits()  # a Bunch: images [n, 8, 8], target [n]
    train_scans, test_scans = _split(digits.target, test_fraction, seed)
    rng = random.Random(seed)
    codec = _video_codec()
    texts: list[str] = []

    def make(clip: dict, pool: dict[int, list[int]]) -> bytes:
        """The clip's mp4; records which scans (indices into `load_digits()`) drew it in `clip["scans"]`."""
        clip["scans"] = [rng.choice(pool[digit]) for digit in clip["digits"]]
        scans = [digits.images[index] for index in clip["scans"]]
        return encode_mp4(_render(clip, scans, frames, size, rng), fps=fps, codec=codec)

    train_clips = [clip for kind in KINDS for clip in _plan(kind, clips_per_kind, rng, exhaustive=False)]
    rng.shuffle(train_clips)
    writers = {lang: ShardSetWriter(staging / "train" / lang, max_samples=shard_size) for lang in LANGUAGES}
    for index, clip in enumerate(train_clips):
        video = make(clip, train_scans)
        for language, writer in writers.items():
            templates = TRAIN_TEMPLATES[clip["kind"], language]
            chosen = rng.sample(templates, min(sentences_per_clip, len(templates)))
            sentences = [caption(template, language, clip) for template in chosen]
            texts += sentences
            meta = {"sentences": sentences, **clip}
            writer.write({"__key__": f"train-{index:05d}", "mp4": video, "json": json.dumps(meta, ensure_ascii=False)})
    for writer in writers.values():
        writer.close()

    test = staging / "test"
    (test / "videos").mkdir(parents=True)
    test_clips = []
    for kind in KINDS:
        count = len(_combos(kind)) if test_clips_per_kind is None else test_clips_per_kind
        test_clips += _plan(kind, count, rng, exhaustive=test_clips_per_kind is None)
    rng.shuffle(test_clips)
    retrieval: dict[str, list[str]] = {language: [] for language in LANGUAGES}
    rows: dict[str, list[tuple[str, str]]] = {language: [] for language in LANGUAGES}
    with ShardSetWriter(test / "test", max_samples=shard_size) as writer:
        for index, clip in enumerate(test_clips):
            key = f"test-{index:04d}"
            video = make(clip, test_scans)
            (test / "videos" / f"{key}.mp4").write_bytes(video)
            captions = {
                lang: [caption(t, lang, clip) for t in EVAL_TEMPLATES[clip["kind"], lang]] for lang in LANGUAGES
            }
            for language, sentences in captions.items():
                texts += sentences
                retrieval[language].append(
                    json.dumps({"video": f"videos/{key}.mp4", "caption": sentences}, ensure_ascii=False)
                )
                rows[language].append((key, sentences[0]))
            writer.write(
                {
                    "__key__": key,
                    "mp4": video,
                    "json": json.dumps({"sentences": captions["en"], **clip}, ensure_ascii=False),
                    "zh.json": json.dumps({"sentences": captions["zh"], **clip}, ensure_ascii=False),
                }
            )
    (test / "nshards.txt").write_text(str(len(writer.sizes)))
    for language in LANGUAGES:
        (test / f"retrieval_{language}.jsonl").write_text("\n".join(retrieval[language]) + "\n", encoding="utf-8")
        with open(test / f"msrvtt_{language}.csv", "w", encoding="utf-8", newline="") as handle:
            table = csv.writer(handle, lineterminator="\n")
            table.writerow(["video_id", "sentence"])
            table.writerows(rows[language])

    train_wordpiece(texts, staging / "tokenizer.json", vocab_size=1000)
    summary = f"train clips: {len(train_clips)}, held-out clips: {len(test_clips)}, frames: {frames}, size: {size}, "
    mark_complete(staging, summary + f"fps: {fps}, codec: {codec}")
    return publish(staging, root)

"""Video-text samples: sample T frames of a clip, decode only those, transform them, tokenize a caption.

A sample holds video bytes (`mp4`, `webm` or `avi`) and text: `txt` (one caption) or `json` (a list of
sentences, or `{"sentences": [...]}`), Chinese or English. An optional `npy` field with precomputed per-frame
features `[N, D]` replaces the video for feature-based training.

Frame sampling follows VINDLU/ViCLIP: the clip is split into T equal segments; training takes a uniformly
random frame inside each segment, evaluation the middle frame of each. Decoding uses decord (the default
where its wheels exist, x86_64) or PyAV. An empty, undecodable or too short video raises ValueError, so
the loader (`data.loader.BatchStream`) skips the sample and counts it, naming its key and shard.

Every random choice (which sentence, which frame in a segment, the frame transform's draws) comes from
torch's default generator, which the loader seeds per sample: a resumed run replays the same choices.
"""

from __future__ import annotations

import io
import json
import os
import platform
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, get_args

import numpy as np
import torch
from PIL import Image

from mmpt.data.image_text import decode_text, pick_field
from mmpt.data.shards import ShardSetWriter

try:
    # Loaded before decord can be: decord loads its bundled FFmpeg libraries (with an old libvpx) into the global
    # symbol namespace, and a PyAV loaded after it then binds to them (its VP9 encoder then fails to open).
    import av  # noqa: F401
except ImportError:  # PyAV is optional where decord decodes
    pass

VIDEO_FIELDS = ("mp4", "webm", "avi")
TEXT_FIELDS = ("txt", "json")
Backend = Literal["decord", "pyav"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def default_backend() -> str:
    """decord where it is installed (it publishes x86_64 wheels only), PyAV elsewhere."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            import decord  # noqa: F401
        except ImportError:
            return "pyav"
        return "decord"
    return "pyav"


def frame_indices(
    num_frames_in_video: int, num_segments: int, train: bool, rng: random.Random | None = None
) -> list[int]:
    """`num_segments` frame indices, one per equal segment of the video, non-decreasing.

    Segment i covers frames [i*N//T, (i+1)*N//T) (at least one frame). Training draws a uniformly random
    frame inside each segment (from `rng`, or from torch's default generator when `rng` is None);
    evaluation takes the segment's middle frame. A video shorter than T frames repeats frames.
    """
    n, t = int(num_frames_in_video), int(num_segments)
    if t < 1:
        raise ValueError(f"num_segments must be at least 1, got {t}")
    if n < 1:
        raise ValueError(f"cannot sample frames from a video with {n} frames")
    if train and rng is None:
        rng = random.Random(int(torch.randint(0, 2**62, ())))
    indices = []
    for i in range(t):
        lo = i * n // t
        hi = max((i + 1) * n // t, lo + 1)
        indices.append(rng.randrange(lo, hi) if rng is not None and train else (lo + hi - 1) // 2)
    return indices


def _check_data(data: bytes) -> bytes:
    if isinstance(data, memoryview | bytearray):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise ValueError(f"video data must be bytes, got {type(data).__name__}")
    if not data:
        raise ValueError("empty video (0 bytes)")
    return data


def _decode_decord(
    data: bytes, indices_fn: Callable[[int], list[int]], num_threads: int, size: tuple[int, int] | None
) -> np.ndarray:
    import decord

    width, height = size or (-1, -1)
    try:
        with _stderr_closed():
            reader = decord.VideoReader(
                io.BytesIO(data), ctx=decord.cpu(0), width=width, height=height, num_threads=num_threads
            )
        count = len(reader)
    except Exception as exc:  # decord raises RuntimeError / DECORDError with long C++ traces
        raise ValueError(f"undecodable video ({len(data)} bytes, decord): {_short(exc)}") from exc
    indices = indices_fn(count)
    try:
        batch = reader.get_batch(list(indices))
    except Exception as exc:
        raise ValueError(f"undecodable video ({len(data)} bytes, {count} frames, decord): {_short(exc)}") from exc
    frames = batch.asnumpy() if hasattr(batch, "asnumpy") else np.asarray(batch)  # any decord bridge
    return np.ascontiguousarray(frames, dtype=np.uint8)


@contextmanager
def _stderr_closed() -> Iterator[None]:
    """This process's stderr (the file descriptor) sent to /dev/null for the block: decord's C++ prints the input of
    an open that fails, for a video given as bytes the raw bytes (binary in the log). The error it raises, in the
    skip's log line, says what failed."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _open_pyav(data: bytes):
    import av

    container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    if not container.streams.video:
        container.close()
        raise ValueError("the file has no video stream")
    return container, container.streams.video[0]


def _pyav_packet_count(data: bytes) -> int:
    container, stream = _open_pyav(data)
    with container:
        return sum(1 for packet in container.demux(stream) if packet.size)


def _pyav_frames(
    data: bytes, wanted: set[int], num_threads: int, size: tuple[int, int] | None
) -> tuple[dict[int, np.ndarray], int]:
    """The wanted frames (by decode order) and how many frames were decoded; stops after the last wanted one."""
    container, stream = _open_pyav(data)
    stream.codec_context.thread_count = num_threads
    last = max(wanted)
    frames: dict[int, np.ndarray] = {}
    decoded = 0
    with container:
        for index, frame in enumerate(container.decode(stream)):
            decoded = index + 1
            if index in wanted:  # scaled while converted to RGB (swscale, area averaging)
                scaled = {"width": size[0], "height": size[1], "interpolation": "AREA"} if size else {}
                # swscale's threads as the decoder's: its default (one per core) slice threads were seen to wait
                # forever in a loader worker forked from a process that had decoded video before
                frames[index] = frame.to_ndarray(format="rgb24", threads=num_threads, **scaled)
            if index >= last:
                break
    return frames, decoded


def _decode_pyav(
    data: bytes, indices_fn: Callable[[int], list[int]], num_threads: int, size: tuple[int, int] | None
) -> np.ndarray:
    from av.error import FFmpegError

    try:
        container, stream = _open_pyav(data)
        with container:
            count = stream.frames  # from the container's index; 0 when unknown (webm, some avi)
        if count <= 0:
            count = _pyav_packet_count(data)
        indices = indices_fn(count)
        frames, decoded = _pyav_frames(data, set(indices), num_threads, size)
        if decoded <= max(indices):  # the index promised more frames than the stream holds: sample again
            if decoded == 0:
                raise ValueError("no frame could be decoded")
            indices = indices_fn(decoded)
            frames, decoded = _pyav_frames(data, set(indices), num_threads, size)
    except (FFmpegError, EOFError, OSError, IndexError) as exc:
        raise ValueError(f"undecodable video ({len(data)} bytes, pyav): {_short(exc)}") from exc
    return np.stack([frames[i] for i in indices]).astype(np.uint8, copy=False)


def _short(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def decode_frames(
    data: bytes,
    indices_fn: Callable[[int], list[int]],
    backend: str | None = None,
    num_threads: int = 1,
    short_side: int | None = None,
) -> np.ndarray:
    """Decode the frames `indices_fn(frame_count)` picks: uint8 array [T, H, W, 3] (RGB), in the picked order.

    decord seeks and decodes the picked frames only; PyAV decodes sequentially up to the last picked
    frame. `short_side`: frames come out with their shorter side scaled down to it (the longer side as
    torchvision's `resize` computes it), scaled by FFmpeg as each frame is converted to RGB, so no
    full-size RGB frame is made; a video already that small is left as it is. ValueError for empty,
    undecodable or too short data (and whatever `indices_fn` raises).
    """
    data = _check_data(data)
    backend = backend or default_backend()
    size = _scaled_size(data, short_side) if short_side is not None else None
    if backend == "decord":
        return _decode_decord(data, indices_fn, num_threads, size)
    if backend == "pyav":
        return _decode_pyav(data, indices_fn, num_threads, size)
    raise ValueError(f"unknown video backend {backend!r}; use one of {', '.join(BACKENDS)}")


def _scaled_size(data: bytes, short_side: int) -> tuple[int, int] | None:
    """(width, height) with the shorter side `short_side`, from the stream's header; None when the video is
    no larger (or its header gives no size: it is decoded as it is, and the transform resizes it)."""
    try:
        container, stream = _open_pyav(data)
        with container:
            width, height = stream.codec_context.width, stream.codec_context.height
    except Exception:  # an unreadable header: the decoder says what is wrong with the video
        return None
    if not width or not height or min(width, height) <= short_side:
        return None
    if width <= height:  # torchvision's rule for the longer side: truncated, not rounded
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


def parse_sentences(data: bytes | str, field: str) -> list[str]:
    """The captions of a text field: `txt` is one caption; `json` a list of strings or {"sentences": [...]}."""
    text = decode_text(data)
    if not field.endswith("json"):
        sentences = [text]
    else:
        value = json.loads(text)
        if isinstance(value, dict):
            value = next((value[k] for k in ("sentences", "captions", "caption") if k in value), None)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"json text must be a list of strings or {{'sentences': [...]}}, got {text[:100]!r}")
        sentences = value
    sentences = [s.strip() for s in sentences if s.strip()]
    if not sentences:
        raise ValueError("the sample has no non-empty caption")
    return sentences


class ResizeCenterCrop:
    """Decoded frames uint8 [T, H, W, 3] -> uint8 tensor [T, 3, size, size]: the shorter side resized to `size`
    (bilinear, antialiased), then the centre crop; all frames in one call.

    `decode_short_side`: the decoder may scale frames to it while decoding (`decode_frames(short_side=)`),
    leaving only the crop here: the same crop of the same geometry, resampled by FFmpeg instead.

    The frames stay uint8: normalisation belongs on the accelerator (`models.victor.FrameEncoder` does it),
    so the loader copies and ships a quarter of the bytes of float frames, and copies them once (when batching).
    """

    def __init__(self, size: int):
        self.size = size
        self.decode_short_side = size

    def __call__(self, frames: np.ndarray) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        clip = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        if min(clip.shape[-2:]) != self.size:
            clip = TF.resize(clip, [self.size], antialias=True)  # the shorter side
        if tuple(clip.shape[-2:]) != (self.size, self.size):
            clip = TF.center_crop(clip, [self.size, self.size])
        return clip  # a channels-last view: batching copies it into place once


class VideoTextDecoder:
    """Raw sample -> {"frames" [T, C, H, W] or "frame_features" [T, D], "input_ids", "attention_mask"}.

    Picklable for loader workers. `frame_transform` maps one PIL frame to a [C, H, W] tensor; its random
    draws are replayed for every frame of a clip (`same_transform_per_clip`), so a random crop or flip is
    the same across the clip. `clip_transform`, when given instead, maps all decoded frames (uint8
    [T, H, W, 3]) at once, e.g. `ResizeCenterCrop`; one with a `decode_short_side` gets frames that decord
    decoded at that size (`decode_frames(short_side=)`). `tokenize(list[str])` returns [n, L] tensors
    (`data.tokenizer.TextTokenizer`).
    When `features_field` (default `npy`) is present, its [N, D] array is sampled with the same rule and no
    video is decoded. `min_frames`: shorter videos fail (and are skipped by the loader).
    """

    def __init__(
        self,
        num_frames: int,
        frame_transform: Callable[[Image.Image], torch.Tensor] | None,
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
        backend: str | None = None,
        train: bool = True,
        min_frames: int = 1,
        features_field: str | None = "npy",
        video_fields: Sequence[str] = VIDEO_FIELDS,
        text_fields: Sequence[str] = TEXT_FIELDS,
        attention_mask: bool = True,
        same_transform_per_clip: bool = True,
        num_threads: int = 1,
        clip_transform: Callable[[np.ndarray], torch.Tensor] | None = None,
    ):
        if num_frames < 1:
            raise ValueError(f"num_frames must be at least 1, got {num_frames}")
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"unknown video backend {backend!r}; use one of {', '.join(BACKENDS)}")
        self.num_frames, self.frame_transform, self.tokenize = num_frames, frame_transform, tokenize
        self.backend, self.train, self.min_frames, self.features_field = backend, train, min_frames, features_field
        self.video_fields, self.text_fields = tuple(video_fields), tuple(text_fields)
        self.attention_mask, self.same_transform_per_clip = attention_mask, same_transform_per_clip
        self.num_threads, self.clip_transform = num_threads, clip_transform

    def _indices(self, count: int, rng: random.Random | None) -> list[int]:
        if count < self.min_frames:
            raise ValueError(f"video has {count} frames, fewer than min_frames={self.min_frames}")
        return frame_indices(count, self.num_frames, self.train, rng)

    def _sentence(self, sample: dict) -> str:
        sentences: list[str] = []
        for name in self.text_fields:
            if name in sample:
                sentences = parse_sentences(sample[name], name)
                break
        else:
            pick_field(sample, self.text_fields, "text")  # raises MissingFieldError naming the sample
        if self.train and len(sentences) > 1:
            return sentences[int(torch.randint(len(sentences), ()))]
        return sentences[0]

    def _transform(self, frames: np.ndarray) -> torch.Tensor:
        if self.clip_transform is not None:
            return self.clip_transform(frames)
        if self.frame_transform is None:
            return torch.from_numpy(frames).permute(0, 3, 1, 2).float().div_(255.0)
        state = torch.random.get_rng_state() if self.same_transform_per_clip else None
        outputs = []
        for frame in frames:
            if state is not None:
                torch.random.set_rng_state(state)
            outputs.append(self.frame_transform(Image.fromarray(frame)))
        return torch.stack(outputs)

    def decode_video(self, data: bytes, rng: random.Random | None = None) -> torch.Tensor:
        """Video bytes -> the T sampled, transformed frames [T, C, H, W] (ValueError if it cannot be read)."""
        # Scaled while decoding where that pays (benchmarks/results/video_at_size.md): decord's scaling beats a
        # full decode and a resize on large frames (1.24x at 720p, 0.94x at 360p), PyAV's never does.
        short_side = getattr(self.clip_transform, "decode_short_side", None) if self.backend == "decord" else None
        frames = decode_frames(
            data, lambda count: self._indices(count, rng), self.backend, self.num_threads, short_side
        )
        return self._transform(frames)

    def __call__(self, sample: dict) -> dict[str, torch.Tensor]:
        text = self._sentence(sample)
        rng = random.Random(int(torch.randint(0, 2**62, ()))) if self.train else None
        out: dict[str, Any] = {}
        if self.features_field and self.features_field in sample:
            features = load_features(sample[self.features_field])
            indices = self._indices(features.shape[0], rng)
            out["frame_features"] = torch.from_numpy(np.ascontiguousarray(features[indices])).float()
        else:
            out["frames"] = self.decode_video(pick_field(sample, self.video_fields, "video"), rng)
        tokens = self.tokenize([text])
        out["input_ids"] = tokens["input_ids"][0]
        if self.attention_mask:
            out["attention_mask"] = tokens["attention_mask"][0]
        return out


def load_features(data: bytes | np.ndarray) -> np.ndarray:
    """Per-frame features [N, D] from `.npy` bytes; ValueError when they are not a 2-d numeric array."""
    array = data if isinstance(data, np.ndarray) else np.load(io.BytesIO(data), allow_pickle=False)
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"frame features must be a numeric [frames, dim] array, got {array.dtype} {array.shape}")
    return array


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def write_video_shards(samples: Iterable[dict], prefix: str, shard_size: int = 1000) -> dict[str, int]:
    """Pack video-text samples into `<prefix>-NNNNNN.tar` shards; returns shard name -> sample count.

    Values may be bytes or str, a list of sentences or a dict (written as json), or a numpy array
    (written as `.npy`); e.g. `{"__key__": "clip1", "mp4": data, "json": {"sentences": [...]}}`.
    """
    with ShardSetWriter(prefix, max_samples=shard_size) as writer:
        for sample in samples:
            packed = {}
            for name, value in sample.items():
                if isinstance(value, np.ndarray):
                    value = npy_bytes(value)
                elif isinstance(value, list | dict):
                    value = json.dumps({"sentences": value} if isinstance(value, list) else value, ensure_ascii=False)
                packed[name] = value
            writer.write(packed)
    return dict(writer.sizes)

"""Where a source's samples keep their caption, image and video, and how their text is encoded.

Shard writers disagree: img2dataset puts the caption column in `<key>.txt` and every saved column
(a second-language caption among them) in `<key>.json`; video corpora keep sentence lists in json.
A source names its fields with keys of two kinds:

- a tar member's extension: `txt`, `jpg`, `mp4`, `seg.png`;
- a field of the sample's json member: `json.caption_zh`, `json.meta.title` (dots walk nested objects).

Several caption keys, or a key whose value is a list of strings, give the sample several captions;
one is drawn per read from the loader's per-sample seed, so a resumed run draws the same one.
`SampleFields.apply` rewrites a raw sample so that the method's decoder finds what was named under
the canonical members (`txt`, `jpg`, `mp4`); sources that name nothing are passed on untouched.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmpt.data.shards import DataError

JSON_PREFIX = "json."
TEXT_MEMBERS = ("txt", "text", "caption", "json")
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
VIDEO_MEMBERS = ("mp4", "webm", "avi")
ENCODING_HINT = "captions must be UTF-8 (or set the source's text_encoding, e.g. gbk)"


class MissingFieldError(DataError):
    """A sample lacks a field the pipeline needs. One such sample is skipped and counted (web data always
    holds a few); a source none of whose first samples has it stops the run (`mmpt.data.loader`)."""


class TextEncodingError(ValueError):
    """A text member that is not valid in the source's encoding; counted as its own skip reason."""


def check_key(key: str, media: bool) -> str:
    """`key` if it is a well-formed field key (a json field only for text); ValueError otherwise."""
    if not key or key.strip() != key or key.startswith(".") or key.endswith("."):
        raise ValueError(f"{key!r} is not a field key: use a tar member's extension (txt) or json.<field>")
    if media and key.startswith(JSON_PREFIX):
        raise ValueError(f"{key!r}: images and videos are tar members (jpg, mp4), not json fields")
    return key


def check_encoding(name: str) -> str:
    try:
        codecs.lookup(name)
    except LookupError:
        raise ValueError(f"{name!r} is not a text encoding Python knows (e.g. utf-8, gbk, gb18030, big5)") from None
    return name


def decode_text(data: bytes | str, encoding: str = "utf-8", where: str = "") -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        hint = ENCODING_HINT if codecs.lookup(encoding).name == "utf-8" else f"not valid {encoding}"
        raise TextEncodingError(f"{where or 'text'} is not valid {encoding} (byte {exc.start}): {hint}") from None


@dataclass(frozen=True)
class SampleFields:
    """The field keys of one source (None: the decoder's defaults) and the encoding of its text members."""

    caption: tuple[str, ...] | None = None
    image: tuple[str, ...] | None = None
    video: tuple[str, ...] | None = None
    text_encoding: str = "utf-8"

    @classmethod
    def of(
        cls,
        caption: str | Sequence[str] | None = None,
        image: str | Sequence[str] | None = None,
        video: str | Sequence[str] | None = None,
        text_encoding: str = "utf-8",
    ) -> SampleFields:
        return cls(
            _keys(caption, media=False),
            _keys(image, media=True),
            _keys(video, media=True),
            check_encoding(text_encoding),
        )

    @property
    def is_default(self) -> bool:
        return (self.caption, self.image, self.video) == (None, None, None) and codecs.lookup(
            self.text_encoding
        ).name == "utf-8"

    def apply(self, sample: dict[str, Any]) -> dict[str, Any]:
        """`sample` with the named fields under the canonical members; text decoded to str."""
        if self.is_default:
            return sample
        sample = dict(sample)
        for member in TEXT_MEMBERS:
            if isinstance(sample.get(member), bytes):
                sample[member] = decode_text(sample[member], self.text_encoding, _where(sample, member))
        if self.caption is not None:
            captions = self.captions(sample)
            chosen = captions[int(torch.randint(len(captions), ()))] if len(captions) > 1 else captions[0]
            for member in TEXT_MEMBERS:
                sample.pop(member, None)
            sample["txt"] = chosen
        for keys, members, canonical, what in (
            (self.image, IMAGE_MEMBERS, "jpg", "image"),
            (self.video, VIDEO_MEMBERS, "mp4", "video"),
        ):
            if keys is not None:
                data = _first(sample, keys, what)
                for member in members:
                    sample.pop(member, None)
                sample[canonical] = data
        return sample

    def image_bytes(self, sample: dict[str, Any]) -> bytes:
        """The sample's image under the image keys (default: the usual image members), for evaluation sets."""
        return _first(sample, self.image or IMAGE_MEMBERS, "image")

    def captions(self, sample: dict[str, Any], default: Sequence[str] = ("txt",)) -> list[str]:
        """Every non-empty caption the caption keys (or the `default` ones) hold, in key order: all of them, as
        an evaluation set reads them; training draws one (`apply`)."""
        parsed_json: Any = None
        captions: list[str] = []
        for key in self.caption or default:
            if key.startswith(JSON_PREFIX):
                if "json" not in sample:
                    continue
                if parsed_json is None:
                    parsed_json = json.loads(sample["json"])
                value = _walk(parsed_json, key[len(JSON_PREFIX) :].split("."))
            else:
                value = sample.get(key)
            if value is None:
                continue
            if isinstance(value, bytes):
                value = decode_text(value, self.text_encoding, _where(sample, key))
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in values):
                raise ValueError(
                    f"{_where(sample, key)} holds {type(value).__name__}, not a caption string or list of strings"
                )
            captions += [v.strip() for v in values if v.strip()]
        if not captions:
            raise MissingFieldError(missing_field(sample, "caption", self.caption or default))
        return captions


def _first(sample: dict[str, Any], keys: Sequence[str], what: str) -> Any:
    found = next((key for key in keys if key in sample), None)
    if found is None:
        raise MissingFieldError(missing_field(sample, what, keys))
    return sample[found]


def _keys(value: str | Sequence[str] | None, media: bool) -> tuple[str, ...] | None:
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else tuple(value)
    if not keys:
        raise ValueError("an empty list of field keys: leave the key out for the default fields")
    return tuple(check_key(key, media) for key in keys)


def _walk(node: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _where(sample: dict[str, Any], key: str) -> str:
    return f"field {key!r} of sample {sample.get('__key__')!r} of {sample.get('__shard__', sample.get('__url__'))}"


def missing_field(sample: dict[str, Any], what: str, keys: Sequence[str]) -> str:
    fields = [_described(sample, k) for k in sorted(sample) if not k.startswith("__")]
    return (
        f"sample {sample.get('__key__')!r} of {sample.get('__shard__', sample.get('__url__'))} has no non-empty "
        f"{what} under {', '.join(keys)} (it has {', '.join(fields) or 'nothing'})"
    )


def _described(sample: dict[str, Any], member: str) -> str:
    """A member's name; the json member's with its top-level keys, what a `json.<key>` names."""
    if member != "json":
        return member
    try:
        parsed = json.loads(sample[member])
    except (ValueError, TypeError):
        return member
    if not isinstance(parsed, dict):
        return member
    shown = ", ".join(f"json.{key}" for key in list(parsed)[:12])
    return f"json ({shown}{', ...' if len(parsed) > 12 else ''})"

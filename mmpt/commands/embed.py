"""Embed the images, videos, texts or dialogs of a shard set with a released model, resumably, in several processes.

    python launch/embed.py --model releases/clip-demo --shards 'data/train-{000000..000099}.tar' \
        --modality image --out embeddings/ --processes 2

For every input shard `<name>.tar` the output holds `<name>.npz` (`keys`: sample keys, `embeddings`:
float32 [n, d], L2-normalised) and `<name>.json` (counts and the samples that could not be embedded,
with the reason). Both are written under temporary names and renamed, the .npz last, so a shard is
either finished or absent: killed and restarted, the job skips finished shards and redoes the rest,
and every sample ends up embedded once or listed once as failed. Shards are dealt to processes
round-robin (`--processes`, or RANK/WORLD_SIZE when started by torchrun). `manifest.json` lists
every shard, its counts and the model, once all are done.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

from mmpt.commands import installed

MODALITY_FIELDS = {
    "image": ("jpg", "jpeg", "png", "webp"),
    "video": ("mp4", "webm", "avi"),
    "text": ("txt", "text", "caption"),
    "dialog": ("json",),
}


def output_paths(out: Path, shard: str) -> tuple[Path, Path]:
    stem = Path(shard).name.removesuffix(".tar")
    return out / f"{stem}.npz", out / f"{stem}.json"


class Embedder:
    """Decodes one modality's samples and embeds batches of them with a loaded release."""

    def __init__(self, model_path: str, modality: str, device: str):
        import mmpt
        from mmpt.config import ConfigError

        self.model = mmpt.load(model_path, device=device)
        embeds = [m for m in MODALITY_FIELDS if hasattr(self.model, f"encode_{m}")]
        if modality not in embeds:
            raise ConfigError(
                f"--modality {modality}: {model_path} is a '{self.model.config.method_name}' model, which embeds "
                f"{', '.join(embeds)}"
            )
        self.pre, self.modality, self.device = self.model.preprocessors(), modality, device

    def prepare(self, sample: dict):
        """The model input of one sample; raises on a sample that cannot be used."""
        from mmpt.data.image_text import decode_image, decode_text, pick_field

        value = pick_field(sample, MODALITY_FIELDS[self.modality], self.modality)
        if self.modality == "image":
            return self.pre["preprocess"](decode_image(value))
        if self.modality == "video":
            return self.pre["video"](value)  # the model's frame sampling and transform (evaluation mode)
        text = decode_text(value)
        if self.modality == "text":
            if not text.strip():
                raise ValueError("empty text")
            return text
        # encoded here, so a turn that cannot be tokenised fails this sample only; batches are padded in `embed`
        return self.pre["tokenizer"].encode(json.loads(text)["turns"])

    def embed(self, items: list):
        import torch

        with torch.no_grad():
            if self.modality == "image":
                features = self.model.encode_image(torch.stack(items).to(self.device))
            elif self.modality == "video":
                features = self.model.encode_video(torch.stack(items).to(self.device))
            elif self.modality == "text":
                tokens = {k: v.to(self.device) for k, v in self.pre["tokenizer"](items).items()}
                features = self.model.encode_text(tokens["input_ids"], tokens["attention_mask"])
            else:
                from mmpt.data.dialog_encoding import collate_dialogs

                batch = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in collate_dialogs(items).items()}
                features = self.model.encode_dialog(batch)
        return features.float().cpu().numpy()


def embed_shard(embedder: Embedder, shard: str, out: Path, batch_size: int) -> dict:
    import numpy as np

    from mmpt.data.stream import read_shard

    keys, embeddings, errors, pending, pending_keys = [], [], [], [], []
    samples = 0

    def flush():
        if pending:
            embeddings.append(embedder.embed(pending))
            keys.extend(pending_keys)
            pending.clear()
            pending_keys.clear()

    for _, sample in read_shard(shard):
        samples += 1
        key = sample.get("__key__")
        try:
            pending.append(embedder.prepare(sample))
            pending_keys.append(key)
        except Exception as exc:  # a bad sample is recorded, not fatal
            errors.append({"key": key, "error": f"{type(exc).__name__}: {exc}"})
        if len(pending) == batch_size:
            flush()
    flush()
    matrix = np.concatenate(embeddings) if embeddings else np.zeros((0, 0), dtype="float32")
    record = {"shard": shard, "samples": samples, "embedded": len(keys), "failed": len(errors), "errors": errors}
    npz, sidecar = output_paths(out, shard)
    _atomic_write(sidecar, json.dumps(record, indent=1).encode())
    buffer = io.BytesIO()
    np.savez(buffer, keys=np.array(keys, dtype=str), embeddings=matrix.astype("float32"))
    _atomic_write(npz, buffer.getvalue())  # last: its presence means the shard is done
    return record


def _atomic_write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    temporary.replace(path)


def run_process(rank: int, world: int, args: argparse.Namespace, shards: list[str]) -> None:
    out = Path(args.out)
    mine = [s for i, s in enumerate(shards) if i % world == rank and not output_paths(out, s)[0].is_file()]
    if not mine:
        return
    embedder = Embedder(args.model, args.modality, args.device)
    for shard in mine:
        record = embed_shard(embedder, shard, out, args.batch_size)
        print(f"[{rank}] {shard}: {record['embedded']} embedded, {record['failed']} failed", flush=True)


def write_manifest(args: argparse.Namespace, shards: list[str]) -> dict | None:
    out = Path(args.out)
    if not all(output_paths(out, s)[0].is_file() for s in shards):
        return None
    records = [json.loads(output_paths(out, s)[1].read_text()) for s in shards]
    manifest = {
        "model": str(args.model),
        "modality": args.modality,
        "shards": [
            {
                "shard": r["shard"],
                "embeddings": output_paths(out, r["shard"])[0].name,
                "samples": r["samples"],
                "embedded": r["embedded"],
                "failed": r["failed"],
            }
            for r in records
        ],
        "samples": sum(r["samples"] for r in records),
        "embedded": sum(r["embedded"] for r in records),
        "failed": sum(r["failed"] for r in records),
    }
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="release or run directory, or hf-hub:<org>/<name>")
    parser.add_argument("--shards", required=True, help="brace pattern or comma list of input shards")
    parser.add_argument("--modality", required=True, choices=sorted(MODALITY_FIELDS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--processes", type=int, default=1, help="ignored when started by torchrun (WORLD_SIZE)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from mmpt.data.shards import DataError, expand_shards

    shards = expand_shards(args.shards)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ:
        run_process(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, shards)
    elif args.processes > 1:
        import torch.multiprocessing as mp

        mp.spawn(  # pyright: ignore[reportPrivateImportUsage]
            run_process, args=(args.processes, args, shards), nprocs=args.processes
        )
    else:
        run_process(0, 1, args, shards)
    manifest = write_manifest(args, shards)  # whichever process finds every shard done writes it
    if manifest is not None:
        print(
            f"{manifest['embedded']} of {manifest['samples']} samples embedded ({manifest['failed']} failed) "
            f"-> {Path(args.out) / 'manifest.json'}"
        )
        if manifest["samples"] and not manifest["embedded"]:  # unusable data, not a run with a few bad samples
            errors = (json.loads(output_paths(Path(args.out), s)[1].read_text())["errors"] for s in shards)
            first = next(e[0] for e in errors if e)
            raise DataError(
                f"{args.shards}: no sample could be embedded as {args.modality}; the first, {first['key']}: "
                f"{first['error']}"
            )
    return 0


run = installed(main)

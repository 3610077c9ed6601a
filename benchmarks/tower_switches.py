"""What gradient checkpointing and patch dropout buy per method: activation bytes per sample, and CPU time of the
image or video tower's training forward + backward, each with the switches off, one at a time, and both on.

Towers at the sizes they train at: clip with a timm ViT-B/16 image tower, open_clip's ViT-B-16, the M²-Encoder
0.4B (configs/m2_encoder/0.4b.yaml, its official size) and VICTOR with a ViT-B/16 frame backbone (8 frames); each
method's demo text tower and settings otherwise (demo corpora built under demo_data/ on first use, for their
tokenizers).

- Activation bytes per sample: the planner's measurement (`mmpt.plan.measure`: the whole training step run on
  fake tensors, live storages counted at the dispatcher, parameter gradients left out), at two micro-batch sizes;
  the slope is bytes per sample. Devices do not change it (dtype aside: fp32 here).
- CPU ms per sample: the tower alone (`encode_image` / `encode_video`, then backward of the features' sum) on real
  tensors, median of --repeats runs at --batch after one untimed run. Absolute CPU times do not carry over to a
  GPU; the ratios between switch settings roughly do for compute-bound towers (checkpointing adds about one
  forward, patch dropout removes the share of tokens it drops).

    python benchmarks/tower_switches.py            # about 5 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VIT_B16 = "{img_size: 224, patch_size: 16, embed_dim: 768, depth: 12, num_heads: 12}"
TOWERS = {  # method -> (config, overrides giving it a tower of the size it trains at)
    "clip": (
        "configs/clip/demo.yaml",
        [
            "method.image.timm_name=vit_base_patch16_224",
            "method.image.image_size=224",
            f"method.image.timm_kwargs={VIT_B16}",
        ],
    ),
    "open_clip": ("configs/open_clip/demo.yaml", ["method.model=ViT-B-16"]),
    "m2_encoder": ("configs/m2_encoder/0.4b.yaml", []),
    "victor": (
        "configs/victor/demo.yaml",
        [
            "method.video.backbone=vit_base_patch16_224",
            "method.video.image_size=224",
            f"method.video.backbone_kwargs={VIT_B16}",
            "method.video.num_frames=8",
        ],
    ),
}
SETTINGS = [(False, 0.0), (True, 0.0), (False, 0.5), (True, 0.5)]  # (gradient checkpointing, patch dropout)


def load(method: str, checkpointing: bool, patch_dropout: float):
    from mmpt import demo
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    path, overrides = TOWERS[method]
    key = get_method(method).tower_switches
    switches = [f"{key}.grad_checkpointing={str(checkpointing).lower()}", f"{key}.patch_dropout={patch_dropout}"]
    cfg = load_config(REPO / path, [*overrides, *switches, "train.precision=fp32"])
    if cfg.data.prepare:
        demo.build(cfg.data.prepare, cfg.data.root)
    return cfg


def activation_bytes_per_sample(cfg) -> float:
    from mmpt.plan.build import built
    from mmpt.plan.measure import measure_step, on_fake_tensors

    with built(cfg) as b, on_fake_tensors(b):
        small, large = measure_step(b, 2), measure_step(b, 4)
    return (large.peak_bytes - small.peak_bytes) / 2


def tower_ms_per_sample(cfg, batch: int, repeats: int) -> float:
    from mmpt.plan.batches import micro_batch
    from mmpt.plan.build import built

    with built(cfg, "cpu") as b:
        b.model.train()
        sample = micro_batch(b, batch)
        video = "frames" in sample
        pixels = torch.randn(sample["frames" if video else "image"].shape)
        encode = b.model.encode_video if video else b.model.encode_image
        times = []
        for run in range(repeats + 1):
            start = time.perf_counter()
            encode(pixels).sum().backward()
            if run:  # the first run is untimed (allocations, first-call work)
                times.append(time.perf_counter() - start)
            b.model.zero_grad(set_to_none=True)
    return statistics.median(times) * 1000 / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(TOWERS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for method in args.methods:
        for checkpointing, patch_dropout in SETTINGS:
            cfg = load(method, checkpointing, patch_dropout)
            row = {
                "method": method,
                "grad_checkpointing": checkpointing,
                "patch_dropout": patch_dropout,
                "activation_mib_per_sample": activation_bytes_per_sample(cfg) / 2**20,
                "tower_cpu_ms_per_sample": tower_ms_per_sample(cfg, args.batch, args.repeats),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write(rows, args)


def write(rows: list[dict], args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "batch": args.batch,
        "repeats": args.repeats,
    }
    (args.out / "tower_switches.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    base = {r["method"]: r for r in rows if not r["grad_checkpointing"] and not r["patch_dropout"]}
    lines = [
        "# Gradient checkpointing and patch dropout per method",
        "",
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}. Produced by `benchmarks/tower_switches.py`. "
        "Activation MiB per sample: the whole training step's working memory (fp32, the planner's fake-tensor "
        "measurement, slope between micro-batches 2 and 4). Tower CPU ms per sample: the image or video tower's "
        f"training forward + backward on real tensors, batch {args.batch}, median of {args.repeats}. Towers: clip "
        "with a ViT-B/16, open_clip ViT-B-16, M²-Encoder 0.4B, VICTOR with a ViT-B/16 frame backbone and 8 "
        "frames (a sample is a clip).",
        "",
        "| method | checkpointing | patch dropout | activation MiB / sample | vs off | tower CPU ms / sample | vs off |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r["method"]]
        lines.append(
            f"| {r['method']} | {'on' if r['grad_checkpointing'] else 'off'} | {r['patch_dropout']:g} | "
            f"{r['activation_mib_per_sample']:.1f} | {r['activation_mib_per_sample'] / b['activation_mib_per_sample']:.2f}x | "
            f"{r['tower_cpu_ms_per_sample']:.0f} | {r['tower_cpu_ms_per_sample'] / b['tower_cpu_ms_per_sample']:.2f}x |"
        )
    (args.out / "tower_switches.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""One ViT-B/16 CLIP training step in bf16 on a GPU: samples/s and model FLOPs utilisation (MFU).

The model is open_clip's ViT-B-16 (random weights), trained with mmpt's global contrastive loss and
AdamW on synthetic inputs already on the device (224 px images, 77-token texts), so the number is
the step itself, not the loader. FLOPs per step are counted once with torch's FlopCounterMode
(forward + backward, matmuls and convolutions); MFU = counted FLOPs x steps/s / the device's dense
bf16 peak (`--peak-tflops`, default by device name: H100/H200 SXM 989). Results are appended to
benchmarks/results/gpu_step.json and written to gpu_step.md with the date and device.

    python benchmarks/gpu_step.py                       # on a GPU machine
    python benchmarks/gpu_step.py --device cpu --batch 4 --steps 3 --dry-run   # checks the script only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--dry-run", action="store_true", help="do not write results")
    args = parser.parse_args()

    import open_clip
    from torch.utils.flop_counter import FlopCounterMode

    from mmpt.losses import ContrastiveLoss

    device = torch.device(args.device)
    model = open_clip.create_model("ViT-B-16", pretrained=None).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    loss_fn = ContrastiveLoss()
    images = torch.randn(args.batch, 3, 224, 224, device=device)
    texts = torch.randint(1, 49407, (args.batch, 77), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            image_features = model.encode_image(images, normalize=True)
            text_features = model.encode_text(texts, normalize=True)
            loss = loss_fn(image_features.float(), text_features.float(), model.logit_scale.exp())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    times = []
    for index in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    seconds = statistics.median(times)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "device": name,
        "torch": torch.__version__,
        "batch": args.batch,
        "step_s": {"min": min(times), "median": seconds, "max": max(times)},
        "samples_per_s": args.batch / seconds,
        "tflops_per_step": flops / 1e12,
        "achieved_tflops": flops / seconds / 1e12,
        "mfu": None if peak is None else flops / seconds / 1e12 / peak,
        "peak_bf16_tflops": peak,
    }
    print(json.dumps(record, indent=2))
    if not args.dry_run:
        RESULTS.mkdir(exist_ok=True)
        history = json.loads((RESULTS / "gpu_step.json").read_text()) if (RESULTS / "gpu_step.json").is_file() else []
        (RESULTS / "gpu_step.json").write_text(json.dumps(history + [record], indent=2) + "\n")
        rows = "".join(_row(r) for r in history + [record])
        (RESULTS / "gpu_step.md").write_text(
            "# ViT-B/16 CLIP step, bf16\n\n| date | device | batch | samples/s | "
            "TFLOP/step | MFU |\n|---|---|---|---|---|---|\n" + rows
        )
    return 0


def _row(r: dict) -> str:
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return f"| {r['date']} | {r['device']} | {r['batch']} | {r['samples_per_s']:.0f} | {r['tflops_per_step']:.2f} | {mfu} |\n"


if __name__ == "__main__":
    sys.exit(main())

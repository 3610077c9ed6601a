"""Loss memory and time of the image-text losses, one process, b pairs of D=512 fp32 features.

    python benchmarks/sigmoid_loss.py            # writes benchmarks/results/sigmoid_loss.md
    python benchmarks/sigmoid_loss.py --quick    # small batches only, printed

Each case runs forward and backward in a fresh process. "Loss memory" is the process's peak resident size
during the loss less its size just before (features and their gradients' storage excluded: both exist
before the call; the gradients the call writes, 2 x b x D x 4 bytes, are included). open_clip's ClipLoss and
SigLipLoss are the reference points. What carries over to a GPU: the memory (the same tensors are allocated);
not the times, which compare kernels on 2 CPU cores. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

DIM = 512
TILE = 512
CASES = (
    "open_clip ClipLoss",
    "contrastive",
    f"contrastive, tile {TILE}",
    "open_clip SigLipLoss",
    "sigmoid",
    f"sigmoid, tile {TILE}",
)
TILED_ONLY_FROM = 32768  # untiled losses past this batch need b^2 x 4 bytes several times over: not run


def build(case: str):
    from open_clip.loss import ClipLoss, SigLipLoss

    from mmpt.losses import GroupedContrastiveLoss, SigmoidLoss

    tile = TILE if "tile" in case else None
    if case == "open_clip ClipLoss":
        return ClipLoss(), False
    if case == "open_clip SigLipLoss":
        return SigLipLoss(), True
    if case.startswith("contrastive"):
        return GroupedContrastiveLoss(tile_size=tile or 0), False
    return SigmoidLoss(tile_size=tile), True


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(case: str, batch: int) -> dict:
    """In this process: one forward and backward of `case` on `batch` pairs."""
    import torch

    torch.manual_seed(0)
    loss, sigmoid = build(case)
    images = torch.nn.functional.normalize(torch.randn(batch, DIM), dim=-1).requires_grad_()
    texts = torch.nn.functional.normalize(torch.randn(batch, DIM), dim=-1).requires_grad_()
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    args = (images, texts, scale, bias) if sigmoid else (images, texts, scale)
    before = resident_mb()
    start = time.perf_counter()
    loss(*args).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {"case": case, "batch": batch, "loss_mb": round(peak - before, 1), "seconds": round(seconds, 2)}


def run_case(case: str, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--case", case, "--batch", str(batch)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| loss | b | loss memory MB | forward + backward s |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['batch']:,} | {r['loss_mb']:,.0f} | {r['seconds']:.2f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--quick", action="store_true", help="b = 1,024 and 4,096 only, printed")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case, args.batch)))
        return
    batches = (1024, 4096) if args.quick else (4096, 16384, 65536)
    rows = []
    for batch in batches:
        for case in CASES:
            if batch >= TILED_ONLY_FROM and "tile" not in case:
                continue
            rows.append(run_case(case, batch))
            print(rows[-1], flush=True)
    if args.quick:
        print(table(rows))
        return
    out = Path(__file__).parent / "results" / "sigmoid_loss.md"
    out.write_text(
        "# Image-text loss memory and time (CPU, one process)\n\n"
        f"Made by `python benchmarks/sigmoid_loss.py`: D = {DIM} fp32 features, forward and backward once per "
        f"case in a fresh process, tiles of {TILE} columns. Loss memory: peak resident size during the call less "
        "the size before it (the features' gradients, 2 x b x D x 4 bytes, included). Untiled losses at "
        f"b >= {TILED_ONLY_FROM:,} are not run (several b x b fp32 matrices). Memory carries over to a GPU; the "
        "times compare kernels on 2 CPU cores.\n\n" + table(rows) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The loss-memory curve of the suite's `loss_memory` stage: peak memory and time of the loss alone against the
batch, per variant, where a reader would rather look than read the table.

    python benchmarks/gpu/plot.py [RESULTS]     # default benchmarks/results/gpu -> loss_memory.png

Needs matplotlib (`pip install -e '.[bench]'`); runs here on the stage file the GPU machine wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"


def plot_loss_memory(folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage = json.loads((folder / "stage-loss_memory.json").read_text())
    found = stage["results"]
    gpu = ((stage.get("environment") or {}).get("gpu") or {}).get("name", "CPU")
    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in found["variants"]:
        done = [t for t in variant["trials"] if t["status"] == "ok"]
        batches = [t["batch"] for t in done]
        memory.plot(batches, [t["peak_mib"] / 1024 for t in done], marker="o", label=variant["variant"])
        seconds.plot(batches, [t["wall_s"] * 1e3 for t in done], marker="o", label=variant["variant"])
        if variant.get("first_oom"):
            memory.axvline(variant["first_oom"], linestyle=":", color=memory.lines[-1].get_color(), linewidth=1)
    for axis, label in ((memory, "peak memory above the features (GiB)"), (seconds, "forward + backward (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("global batch b")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    memory.legend(title="dotted: first out of memory")
    figure.suptitle(f"Contrastive loss alone on {gpu}: D = {found['dim']}, float32, tile {found['tile_size']}, world 1")
    figure.tight_layout()
    path = folder / "loss_memory.png"
    figure.savefig(path, dpi=110)
    return path


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else RESULTS
    if not (folder / "stage-loss_memory.json").is_file():
        print(f"no loss_memory stage file in {folder}", file=sys.stderr)
        return 2
    print(f"wrote {plot_loss_memory(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

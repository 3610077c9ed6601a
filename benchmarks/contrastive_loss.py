"""GBA-ITC vs open_clip's ClipLoss, side by side in one run, on CPU gloo ranks.

For N ranks (processes) and per-rank batch b (D = 512 features), each variant runs forward +
backward of the loss alone on the same features:

- clip:          open_clip ClipLoss(local_loss=True, gather_with_grad=True)
- gba G=N:       GBA-ITC, one group of all ranks, untiled / tiled
- gba G=N/2:     GBA-ITC, groups of half the ranks, untiled / tiled

Reported per variant (rank 0; all ranks do the same work): median time per forward+backward,
peak resident memory above the pre-loss baseline (sampled every millisecond), and the feature bytes
each rank receives in the forward and in the backward, counted on the collectives actually called
(ring cost model: all_gather and reduce_scatter receive (G-1)/G of the full tensor, all_reduce twice
that; a scatter delivers one block to each non-source rank). Memory is measured in a second pass of
its own, with large allocations forced onto mmap (MALLOC_MMAP_THRESHOLD_) so freed memory leaves
the resident set and peaks are comparable; times come from the first pass, with the default allocator. Results go to benchmarks/results/contrastive_loss.{json,md,png}.

    python benchmarks/contrastive_loss.py                 # the committed grid (~15 minutes on 2 cores)
    python benchmarks/contrastive_loss.py --quick         # N=2, b=256 only
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import RESULTS, free_port, save_results

DIM = 512


class Traffic:
    """Counts the bytes a rank receives through the collectives it calls (ring algorithms)."""

    def __init__(self):
        self.bytes = 0
        self._originals = {}

    def __enter__(self):
        for name, factor in (
            ("all_gather", 1),
            ("all_gather_into_tensor", 1),
            ("reduce_scatter", 1),
            ("reduce_scatter_tensor", 1),
            ("all_reduce", 2),
        ):
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._counting(original, factor))
        scatter = dist.scatter
        self._originals["scatter"] = scatter

        def counting_scatter(tensor, scatter_list=None, src=0, group=None, **kwargs):
            if dist.get_rank() != src:  # a scatter delivers one block to every rank but the source
                self.bytes += tensor.numel() * tensor.element_size()
            return scatter(tensor, scatter_list, src=src, group=group, **kwargs)

        dist.scatter = counting_scatter
        return self

    def _counting(self, original, factor):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [a for a in args if isinstance(a, list)]
            full = sum(t.numel() * t.element_size() for t in (lists[0] if lists else tensors[:1]))
            if original.__name__ in ("reduce_scatter", "reduce_scatter_tensor") and tensors:
                full = max(t.numel() * t.element_size() for t in tensors)
            self.bytes += factor * full * (size - 1) // size
            return original(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


class PeakMemory:
    """Peak RSS above the level at entry, sampled every millisecond in a thread."""

    def __enter__(self):
        self._process = psutil.Process()
        self.baseline = self.peak = self._process.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.baseline) / 2**20


def variants(world: int, rows: int):
    from open_clip.loss import ClipLoss

    from mmpt.distributed import contiguous_group
    from mmpt.losses.grouped_itc import GroupedContrastiveLoss

    rank = dist.get_rank()
    full = None
    half = contiguous_group(world // 2) if world > 2 else None  # groups must be made on every rank
    tile = 1024
    out = [("clip", world, ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world))]
    out.append(("gba G=N", world, GroupedContrastiveLoss(full)))
    out.append(("gba G=N tiled", world, GroupedContrastiveLoss(full, tile_size=tile)))
    if world > 2:
        out.append(("gba G=N/2", world // 2, GroupedContrastiveLoss(half)))
        out.append(("gba G=N/2 tiled", world // 2, GroupedContrastiveLoss(half, tile_size=tile)))
    return out


def measure(loss, rows: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(dist.get_rank())
    image = F.normalize(torch.randn(rows, DIM, generator=gen), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(rows, DIM, generator=gen), dim=-1).requires_grad_()
    scale = torch.tensor([14.0], requires_grad=True)
    times, peaks, forward_bytes, backward_bytes = [], [], 0, 0
    for attempt in range(repeats + 1):
        image.grad = text.grad = scale.grad = None
        dist.barrier()
        with PeakMemory() as memory:
            start = time.perf_counter()
            with Traffic() as forward_traffic:
                value = loss(image, text, scale)
            with Traffic() as backward_traffic:
                value.backward()
            elapsed = time.perf_counter() - start
        dist.barrier()
        if attempt:  # the first run warms up
            times.append(elapsed)
            peaks.append(memory.extra_mb)
            forward_bytes, backward_bytes = forward_traffic.bytes, backward_traffic.bytes
    return {
        "time_s": statistics.median(times),
        "time_min_s": min(times),
        "time_max_s": max(times),
        "peak_mb": statistics.median(peaks),
        "forward_bytes": forward_bytes,
        "backward_bytes": backward_bytes,
    }


def worker(rank: int, world: int, port: int, batches: list[int], repeats: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for rows in batches:
            for name, group, loss in variants(world, rows):
                result = measure(loss, rows, repeats if rows < 4096 else max(1, repeats - 1))
                if rank == 0:
                    expected = 2 * (group - 1) * rows * DIM * 4
                    queue.put(
                        {
                            "N": world,
                            "b": rows,
                            "variant": name,
                            "G": group,
                            "expected_forward_bytes": expected,
                            **result,
                        }
                    )
    finally:
        dist.destroy_process_group()
        if rank == 0:
            queue.put(None)


def run_world(world: int, batches: list[int], repeats: int, memory_pass: bool = False) -> list[dict]:
    if memory_pass:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # read by each spawned worker's libc
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=worker, args=(r, world, port, batches, repeats, queue)) for r in range(world)]
    for p in processes:
        p.start()
    rows = []
    while (item := queue.get()) is not None:
        rows.append(item)
        print(
            f"{'memory ' if memory_pass else ''}N={item['N']} b={item['b']:5d} {item['variant']:16s} {item['time_s'] * 1000:9.1f} ms "
            f"{item['peak_mb']:8.1f} MB  fwd {item['forward_bytes'] / 2**20:7.2f} MiB "
            f"(expected {item['expected_forward_bytes'] / 2**20:7.2f})",
            flush=True,
        )
    for p in processes:
        p.join()
    return rows


def write_report(rows: list[dict]) -> None:
    clip = {(r["N"], r["b"]): r for r in rows if r["variant"] == "clip"}
    lines = [
        "# Contrastive loss: GBA-ITC vs open_clip ClipLoss (forward + backward of the loss alone)",
        "",
        f"CPU gloo, D = {DIM}, fp32, tile = 1024 columns. Machine: {os.cpu_count()} cores, torch {torch.__version__}.",
        "Time: median (min-max) per forward+backward. Peak: resident memory above the pre-loss level.",
        "Bytes: feature bytes one rank receives through the collectives called (ring model). gloo has no",
        "reduce-scatter: GBA-ITC's backward emulates it with scatters, torch's (ClipLoss) with all-to-all.",
        "",
        "| N | b | loss | G | time ms | x clip | peak MB | x clip | fwd MiB | expected 2(G-1)bD MiB | bwd MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = clip[(r["N"], r["b"])]
        lines.append(
            f"| {r['N']} | {r['b']} | {r['variant']} | {r['G']} | {r['time_s'] * 1e3:.1f} "
            f"({r['time_min_s'] * 1e3:.1f}-{r['time_max_s'] * 1e3:.1f}) | {r['time_s'] / base['time_s']:.2f} | "
            f"{r['peak_mb']:.1f} | {r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f} | {r['forward_bytes'] / 2**20:.2f} | "
            f"{r['expected_forward_bytes'] / 2**20:.2f} | {r['backward_bytes'] / 2**20:.2f} |"
        )
    save_results("contrastive_loss", rows, lines)
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(2, len(worlds), figsize=(5 * len(worlds), 7), squeeze=False)
    for col, world in enumerate(worlds):
        for name in dict.fromkeys(r["variant"] for r in rows if r["N"] == world):
            series = sorted(
                (r["b"], r["time_s"] * 1e3, r["peak_mb"]) for r in rows if r["N"] == world and r["variant"] == name
            )
            axes[0][col].plot([s[0] for s in series], [s[1] for s in series], marker="o", label=name)
            axes[1][col].plot([s[0] for s in series], [s[2] for s in series], marker="o", label=name)
        for row, label in enumerate(("time per fwd+bwd (ms)", "peak extra memory (MB)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("per-rank batch b")
            ax.set_ylabel(label)
            ax.set_title(f"N = {world} CPU ranks")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "contrastive_loss.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    worlds, batches = ([2], [256]) if args.quick else ([2, 4], [256, 1024, 4096])
    rows = [row for world in worlds for row in run_world(world, batches, args.repeats)]
    print("memory pass", flush=True)
    peaks = {
        (r["N"], r["b"], r["variant"]): r["peak_mb"]
        for world in worlds
        for r in run_world(world, batches, 1, memory_pass=True)
    }
    for row in rows:
        row["peak_mb"] = peaks[(row["N"], row["b"], row["variant"])]
    write_report(rows)
    at = [r for r in rows if r["N"] == max(worlds) and r["b"] == max(batches)]
    clip = next(r for r in at if r["variant"] == "clip")
    for r in at:
        if r["variant"] != "clip":
            print(
                f"N={r['N']} b={r['b']} {r['variant']}: time x{r['time_s'] / clip['time_s']:.2f}, "
                f"peak memory x{r['peak_mb'] / max(clip['peak_mb'], 1e-9):.2f} of ClipLoss"
            )


if __name__ == "__main__":
    main()

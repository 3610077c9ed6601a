"""ZeRO-3's prefetch trace under GBA-ITC's pooled accumulation: how often DeepSpeed throws it away.

DeepSpeed 0.19's ZeRO-3 records the order in which one forward and its backward use the model's modules
(a "period", which starts at each forward of the engine's module) and, once recorded, prefetches each
module's parameters ahead of use. A period that uses the modules in another order invalidates the trace;
the next period records it again, without prefetching. With pooled accumulation a step runs one pool pass
(a forward over all K micro-batches, no backward) and then K forward+backward periods, so the periods of a
step are not all alike. This counts, on 2 gloo ranks and a small M²-Encoder (ZeRO-3, fp32), the
invalidations and the periods run without a complete trace, per step after the first two, for K = 1, 2, 4,
with the pool pass on the training pass's trace (as DeepSpeed alone runs it) and on its own
(`mmpt/engine/pool_trace.py`, what training uses).
Results: benchmarks/results/zero3_trace.{json,md}.

    python benchmarks/zero3_trace.py                  # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from demo_runs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
WORLD, STEPS, ROWS = 2, 8, 8
ARCH = {
    "vocab_size": 64,
    "width": 64,
    "heads": 2,
    "lower_layers": 2,
    "shared_layers": 1,
    "output_dim": 32,
    "image_size": 32,
    "patch_size": 16,
    "text_positions": 16,
    "context_length": 8,
    "position_init_std": 0.02,
}


def config(run_dir: str, accum: int):
    from mmpt.config_loader import validate_config

    return validate_config(
        {
            "method": {"name": "m2_encoder", "model": "m2-encoder-demo", "arch": ARCH, "tokenizer": "unused.json"},
            "data": {"train": {"sources": [{"shards": "unused.tar"}], "batch_size": ROWS // accum}},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "train": {"max_steps": STEPS, "zero_stage": 3, "grad_accum": accum, "grad_clip": 1.0},
            "run": {"output_dir": run_dir, "progress_bar": False, "tensorboard": False},
        }
    )


def batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {
        "image": torch.randn(rows, 3, 32, 32, generator=gen),
        "input_ids": torch.randint(1, ARCH["vocab_size"], (rows, ARCH["context_length"]), generator=gen),
        "attention_mask": torch.ones(rows, ARCH["context_length"], dtype=torch.long),
    }


def count_on_rank(rank: int, port: int, tmp: str, queue) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from mmpt import distributed as mdist
    from mmpt.engine.run import build_engine
    from mmpt.engine.trainer import optimizer_step
    from mmpt.methods import get_method

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    counts = {"invalidated": 0, "periods_without_trace": 0}
    invalidate, reset = PartitionedParameterCoordinator._invalidate_trace, PartitionedParameterCoordinator.reset_step

    def counting_invalidate(self):
        counts["invalidated"] += 1
        invalidate(self)

    def counting_reset(self):
        counts["periods_without_trace"] += not self.is_complete_trace()
        reset(self)

    PartitionedParameterCoordinator._invalidate_trace = counting_invalidate
    PartitionedParameterCoordinator.reset_step = counting_reset
    results = {}
    for accum, own in ((1, True), (2, False), (2, True), (4, False), (4, True)):
        cfg = config(f"{tmp}/k{accum}{own}", accum)
        engine, _, _ = build_engine(cfg, get_method("m2_encoder"), mdist.layout(), WORLD)
        if not own:  # the pool pass on the training pass's trace, as DeepSpeed alone runs it
            engine.module.pool_trace = None
        per_step = []
        for step in range(STEPS):
            before = dict(counts)
            whole = batch(1000 * step + rank, ROWS)
            optimizer_step(engine, [dict(zip(whole, v)) for v in zip(*(t.chunk(accum) for t in whole.values()))])
            per_step.append({k: counts[k] - before[k] for k in counts})
        engine.destroy()
        results[f"{accum}, {'own' if own else 'shared'}"] = per_step
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue, port, tmp = ctx.Queue(), free_port(), tempfile.mkdtemp(prefix="mmpt-trace-")
    processes = [ctx.Process(target=count_on_rank, args=(r, port, tmp, queue)) for r in range(WORLD)]
    for process in processes:
        process.start()
    found = dict(queue.get(timeout=900) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    per_k = found[0]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "steps": STEPS,
        "per_step": {str(k): v for k, v in per_k.items()},
    }
    lines = [
        "# ZeRO-3's prefetch trace under pooled accumulation",
        "",
        f"{record['date']}, {record['machine']}; 2 gloo ranks, a small M²-Encoder at ZeRO-3 (fp32), {STEPS} "
        "steps, rank 0's counts. `python benchmarks/zero3_trace.py`",
        "",
        "| K (micro-batches per step) | pool pass trace | periods per step | invalidations per step, steps 3+ "
        "| periods without a complete trace per step, steps 3+ |",
        "|---|---|---|---|---|",
    ]
    for name, steps in per_k.items():
        accum, trace = name.split(", ")
        late = steps[2:]
        periods = int(accum) + (1 if int(accum) > 1 else 0)
        invalidated = sum(s["invalidated"] for s in late) / len(late)
        untraced = sum(s["periods_without_trace"] for s in late) / len(late)
        shown = "-" if accum == "1" else ("its own" if trace == "own" else "the training pass's")
        lines.append(f"| {accum} | {shown} | {periods} | {invalidated:g} | {untraced:g} |")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "zero3_trace.json").write_text(json.dumps(record, indent=2) + "\n")
    (results / "zero3_trace.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

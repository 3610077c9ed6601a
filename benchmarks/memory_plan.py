"""The planner's predictions against measurement.

Working bytes of one micro-batch, predicted from fake tensors (two batch sizes, a line through them), against
the same step run on real CPU tensors at another batch size, with and without gradient checkpointing,
measured two ways: the planner's own live-storage counter on real tensors, and independently of it, the CPU
allocator's own allocation and free records as torch.profiler reports them (profile_memory), summed in order.

Model-state bytes per rank, predicted by `mmpt.plan.states`, against what each of 2 gloo ranks of a DeepSpeed
engine built as training builds it actually holds at its peak (`mmpt.plan.held`), at ZeRO 0-3 in fp32 and bf16.

    python benchmarks/memory_plan.py        # writes benchmarks/results/memory_plan.{md,json}
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from common import free_port
from torch.profiler import ProfilerActivity
from torch.profiler import profile as profiler

from mmpt.config_loader import load_config
from mmpt.engine.precision import policy
from mmpt.plan.batches import micro_batch
from mmpt.plan.build import built
from mmpt.plan.held import HELD_BUCKET
from mmpt.plan.measure import drop_gradients, measure_step, run_step, set_checkpointing
from mmpt.plan.profile import profile

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("configs/m2_encoder/demo.yaml", [], 16),
    ("configs/m2_encoder/demo.yaml", ["method.arch.grad_checkpointing=true"], 16),
    ("configs/m2_encoder/0.4b.yaml", ["method.arch.lower_layers=2", "method.arch.shared_layers=1"], 3),
    (
        "configs/m2_encoder/0.4b.yaml",
        ["method.arch.lower_layers=2", "method.arch.shared_layers=1", "method.arch.grad_checkpointing=true"],
        3,
    ),
    ("configs/clip/demo.yaml", [], 16),
]


@contextmanager
def real_model(config: str, overrides: list[str]) -> Iterator[Any]:
    """The model built with real weights on CPU, initialised as training initialises them, in the dtype training
    holds it in (bf16 at ZeRO-0 is autocast over an fp32 model: `mmpt.engine.precision.policy`)."""
    cfg = load_config(ROOT / config, overrides)
    with built(cfg, device="cpu") as b:
        b.model.to(policy(cfg.train.precision, cfg.train.zero_stage).model)
        set_checkpointing(b.model, bool(getattr(getattr(cfg.method, "arch", None), "grad_checkpointing", False)))
        yield b


def measured(config: str, overrides: list[str], batch: int) -> int:
    """Peak working bytes of one real micro-batch on CPU."""
    with real_model(config, overrides) as b:
        return measure_step(b, batch).peak_bytes


def allocator_peak(config: str, overrides: list[str], batch: int) -> int:
    """Peak of one real micro-batch on CPU as the allocator records it: torch.profiler's memory records (every
    allocation and free, in order) summed, their running maximum taken. Gradients are freed once accumulated,
    as the planner's working bytes exclude them (model states count them)."""
    with real_model(config, overrides) as b:
        b.model.train()
        inputs = micro_batch(b, batch)
        handles = drop_gradients(b.model)
        with profiler(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run_step(b, inputs)
        for handle in handles:
            handle.remove()
    live = peak = 0
    kineto: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    records = [e for e in kineto.events() if e.name() == "[memory]"]
    for event in sorted(records, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


STATES_CONFIG = "configs/m2_encoder/demo.yaml"


def _held_rank(rank: int, port: int, queue) -> None:
    import deepspeed
    import torch.distributed as dist

    from mmpt.plan.held import held_and_planned

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ["WORLD_SIZE"] = "2"
    backend = importlib.import_module("deepspeed.comm.torch")
    setattr(backend, "build_shm_op", lambda: None)  # noqa: B010 (gloo only: no C++ build)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    deepspeed.init_distributed(dist_backend="gloo")
    rows = []
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            tokenizer = f"{ROOT}/demo_data/digits/tokenizer.json"
            held, predicted = held_and_planned(ROOT / STATES_CONFIG, tokenizer, stage, precision)
            rows.append(
                {
                    "config": STATES_CONFIG,
                    "rank": rank,
                    "zero_stage": stage,
                    "precision": precision,
                    "predicted_bytes": predicted,
                    "held_bytes": held.total,
                    "held": {"parameters": held.parameters, "gradients": held.gradients, "optimizer": held.optimizer},
                    "error": predicted / held.total - 1,
                }
            )
    dist.barrier()
    queue.put(rows)
    dist.destroy_process_group()


def held_states() -> list[dict]:
    """Model states predicted and held, per stage and precision, on 2 spawned gloo ranks."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=_held_rank, args=(rank, port, queue)) for rank in range(2)]
    for p in ranks:
        p.start()
    rows = [row for _ in ranks for row in queue.get(timeout=900)]
    for p in ranks:
        p.join(timeout=300)
    return sorted(rows, key=lambda r: (r["precision"], r["zero_stage"], r["rank"]))


def main() -> None:
    rows = []
    for config, overrides, batch in CASES:
        cfg = load_config(ROOT / config, overrides)
        predicted = profile(cfg).activations.at(batch)
        real = measured(config, overrides, batch)
        allocated = allocator_peak(config, overrides, batch)
        rows.append(
            {
                "config": config,
                "overrides": overrides,
                "micro_batch": batch,
                "predicted_bytes": int(predicted),
                "measured_bytes": real,
                "allocator_bytes": allocated,
                "error": predicted / real - 1,
                "allocator_error": predicted / allocated - 1,
            }
        )
        print(rows[-1], flush=True)
    states = held_states()
    for row in states:
        print(row, flush=True)
    out = ROOT / "benchmarks/results"
    (out / "memory_plan.json").write_text(json.dumps({"activations": rows, "model_states": states}, indent=2) + "\n")
    lines = [
        "# Planner against measurement",
        "",
        "## Working bytes of one micro-batch",
        "",
        "Predicted: `mmpt.plan.profile` (fake tensors at two other batch sizes, a line through them). Measured on",
        "the same training step run on real CPU tensors (the model built and initialised as training builds it),",
        "parameter gradients freed as they are accumulated (model states count them), two ways:",
        "",
        "- counter: the planner's own live-storage counter (`mmpt.plan.measure.LiveBytes`) on the real tensors;",
        "- allocator: independent of the planner, the CPU allocator's allocation and free records that",
        "  `torch.profiler` reports with `profile_memory=True`, summed in order, their running maximum.",
        "",
        "| config | overrides | micro-batch | predicted MB | counter MB | error | allocator MB | error |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['config']} | {' '.join(r['overrides']) or '-'} | {r['micro_batch']} | "
            f"{r['predicted_bytes'] / 1e6:.1f} | {r['measured_bytes'] / 1e6:.1f} | {r['error']:+.1%} | "
            f"{r['allocator_bytes'] / 1e6:.1f} | {r['allocator_error']:+.1%} |"
            for r in rows
        ),
        "",
        "## Model states per rank",
        "",
        f"Predicted: `mmpt.plan.states` from the meta-device counts of {STATES_CONFIG} ({HELD_BUCKET:,}-element",
        "gradient bucket at ZeRO 1-3; ZeRO-3's gathered layer left out, as it is released after each use).",
        "Held: what each of 2 gloo ranks of a DeepSpeed engine built by `mmpt.engine.run.build_engine` holds at",
        "its peak in the second optimizer step, counted from the tensors (`mmpt.plan.held`): parameters and",
        "ZeRO-3 partitions, `.grad`, and everything the optimizer reaches (flat groups, fp32 master partitions,",
        "gradient partitions and accumulators, buckets, Adam moments).",
        "",
        "| ZeRO | precision | rank | predicted KB | held KB | parameters KB | gradients KB | optimizer KB | error |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['zero_stage']} | {r['precision']} | {r['rank']} | {r['predicted_bytes'] / 1e3:.0f} | "
            f"{r['held_bytes'] / 1e3:.0f} | {r['held']['parameters'] / 1e3:.0f} | "
            f"{r['held']['gradients'] / 1e3:.0f} | {r['held']['optimizer'] / 1e3:.0f} | {r['error']:+.1%} |"
            for r in states
        ),
        "",
    ]
    (out / "memory_plan.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

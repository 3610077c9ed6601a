"""CPU training step time with `train.compile: true` against eager, per method.

Each method's demo config (configs/<method>/demo.yaml: its demo model size and demo corpus, built under
--data-root on first use) is trained in this process (a world of one, ZeRO-0, fp32, the config's micro-batches per step) through the engine
(`mmpt.engine.run.build_engine` and the trainer's `optimizer_step`): once eager, once with its towers
compiled. Both read the same batches, loaded before timing, so the number is the step, not the loader.
The first --warmup steps are timed apart (compilation happens there); the median of the next --steps
steps is the step time. Results: benchmarks/results/compile_step.{json,md}.

    python benchmarks/compile_step.py                                   # the timed run: every method
    python benchmarks/compile_step.py --methods clip --batch 4 --steps 1 --warmup 1 --dry-run   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def load(method: str, run_dir: Path, data_root: Path, batch: int | None, compiled: bool):
    from mmpt.config_loader import load_config

    overrides = [
        f"run.output_dir={run_dir}",
        f"data.root={data_root}",
        "data.train.num_workers=0",
        "data.eval=[]",
        "train.zero_stage=0",
        "train.precision=fp32",
        f"train.compile={str(compiled).lower()}",
        "run.progress_bar=false",
        "run.tensorboard=false",
        *([f"data.train.batch_size={batch}"] if batch else []),
    ]
    return load_config(REPO / "configs" / method / "demo.yaml", overrides)


def time_steps(method_name: str, data_root: Path, batch: int | None, compiled: bool, warmup: int, steps: int) -> dict:
    from mmpt import distributed as mdist
    from mmpt.data.loader import StatefulLoader
    from mmpt.engine.run import build_engine, prepare_run_dir, seed_everything
    from mmpt.engine.trainer import optimizer_step
    from mmpt.methods import get_method

    method = get_method(method_name)
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        cfg = load(method_name, run_dir, data_root, batch, compiled)
        prepare_run_dir(cfg, method, run_dir)
        engine, _, _ = build_engine(cfg, method, mdist.layout(), 1)
        stream = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=0, world_size=1)))
        accum = cfg.train.grad_accum  # a step's micro-batches (GBA-ITC pools the M²-Encoder's over them)
        steps_batches = [[next(stream) for _ in range(accum)] for _ in range(warmup + steps)]
        seed_everything(0)
        times = []
        for micro_batches in steps_batches:
            start = time.perf_counter()
            terms = optimizer_step(engine, micro_batches)
            float(sum(terms.values()))  # the step's work is done when its loss is read
            times.append(time.perf_counter() - start)
        engine.destroy()
    return {
        "batch": cfg.data.train.batch_size,
        "accum": cfg.train.grad_accum,
        "warmup_s": round(sum(times[:warmup]), 2),
        "step_s": round(statistics.median(times[warmup:]), 4),
    }


def main() -> int:
    from mmpt.engine.run import start_process_group
    from mmpt.methods import list_methods

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list_methods())
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default: the demo config's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data-root", type=Path, default=REPO / "demo_data")
    parser.add_argument("--dry-run", action="store_true", help="do not write results")
    args = parser.parse_args()

    start_process_group(1800.0)
    rows = []
    for name in args.methods:
        eager = time_steps(name, args.data_root, args.batch, False, args.warmup, args.steps)
        compiled = time_steps(name, args.data_root, args.batch, True, args.warmup, args.steps)
        row = {
            "method": name,
            "batch": eager["batch"],
            "accum": eager["accum"],
            "eager_step_s": eager["step_s"],
            "compiled_step_s": compiled["step_s"],
            "speedup": round(eager["step_s"] / compiled["step_s"], 2),
            "eager_warmup_s": eager["warmup_s"],
            "compiled_warmup_s": compiled["warmup_s"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.dry_run:
        return 0
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "steps": args.steps,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_step.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Compiled steps on CPU",
        "",
        f"{record['date']}, {record['machine']}, torch {record['torch']}, {record['threads']} threads; each "
        f"method's demo config, ZeRO-0 fp32, one process; median of {args.steps} steps after {args.warmup} "
        "(warm-up time includes compilation). `python benchmarks/compile_step.py`",
        "",
        "| method | micro-batch x accumulation | eager step (s) | compiled step (s) | speed-up | eager warm-up (s) | compiled warm-up (s) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['method']} | {r['batch']} x {r['accum']} | {r['eager_step_s']} | {r['compiled_step_s']} | {r['speedup']} | "
            f"{r['eager_warmup_s']} | {r['compiled_warmup_s']} |"
            for r in rows
        ),
    ]
    (RESULTS / "compile_step.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Samples/s with one rank slowed 2x, fixed per-rank batches against adaptive ones (`train.adaptive_batch`).

2 CPU ranks (`deepspeed --num_gpus 2 launch/train.py`, one core each) train the open_clip ViT of
`benchmarks/configs/bench-vit-tiny.json` (22M parameters, 64 px) from scratch on the digits corpus, ZeRO-2,
fp32, a global batch of 2 x --batch. Rank 1 is slowed with the fault injector
(`MMPT_INJECT_FAULT=slow_compute:rank=1:factor=2`: each stretch of its own work between two points of the
loop takes twice as long, collectives excluded), as a throttled GPU or a node sharing its CPUs would be.
Four runs, alternated over --repeats: clean and slowed, each with fixed and with adaptive batches. A run's
throughput is the median of its logging windows' samples/s after the first --settle steps (the adaptive
runs re-decide their shares in that time); the shares of the last window are reported.
Results: benchmarks/results/adaptive_batch.{json,md}.

    python benchmarks/adaptive_batch.py                 # ~10 minutes on 2 cores
    python benchmarks/adaptive_batch.py --repeats 1 --steps 14 --settle 8 --results /tmp/ab   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from demo_runs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = REPO / "benchmarks" / "configs" / "bench-vit-tiny.json"
SLOW = "slow_compute:rank=1:factor=2"
RUNS = {  # name: (fault, adaptive)
    "clean, fixed": ("", False),
    "clean, adaptive": ("", True),
    "rank 1 slowed 2x, fixed": (SLOW, False),
    "rank 1 slowed 2x, adaptive": (SLOW, True),
}


def config(run_dir: Path, data: Path, args: argparse.Namespace, adaptive: bool) -> dict:
    return {
        "method": {"name": "open_clip", "model": str(MODEL), "zeroshot": {"dataset": None}},
        "data": {
            "train": {
                "sources": [{"shards": str(data / "train/en-*.tar")}],
                "batch_size": args.batch,
                "num_workers": 1,
                "shuffle_buffer": 1000,
            }
        },
        "optim": {"lr": 5e-4, "warmup_steps": 5},
        "train": {
            "max_steps": args.steps,
            "grad_clip": 1.0,
            "zero_stage": 2,
            "log_every": args.log_every,
            "save_every": 0,
            "adaptive_batch": adaptive,
            "adaptive_batch_units": args.units,
        },
        "run": {"output_dir": str(run_dir), "resume": "none", "tensorboard": False, "progress_bar": False},
    }


def one_run(name: str, data: Path, work: Path, args: argparse.Namespace) -> dict:
    fault, adaptive = RUNS[name]
    slug = name.replace(",", "").replace(" ", "-")
    run_dir, path = work / slug, work / f"{slug}.yaml"
    shutil.rmtree(run_dir, ignore_errors=True)
    path.write_text(yaml.safe_dump(config(run_dir, data, args, adaptive)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MMPT_INJECT_FAULT": fault}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    command = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py", "--config", str(path)]
    log = work / f"{slug}.log"
    with log.open("w") as out:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{name}: the launcher exited with {code}; see {log}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "samples_per_s" in r and r["step"] > args.settle]
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in windows),
        "micro_batch_per_rank": windows[-1].get("micro_batch_per_rank", [args.batch, args.batch]),
        "busy_time_per_rank": windows[-1].get("busy_time_per_rank"),
    }


def markdown(record: dict) -> str:
    rows = record["runs"]
    fixed, adaptive = rows["rank 1 slowed 2x, fixed"], rows["rank 1 slowed 2x, adaptive"]
    lines = [
        "# Adaptive per-rank batches with a slow rank",
        "",
        f"{record['date']}, {record['machine']}, torch {record['torch']}; 2 CPU ranks, one core each, ZeRO-2 fp32, "
        f"open_clip ViT bench-vit-tiny (22M) at 64 px, global batch {2 * record['batch']}, adaptive units of "
        f"{record['batch'] // record['units']} samples; median samples/s of the logging windows after step "
        f"{record['settle']} of {record['steps']}, {record['repeats']} runs each (min-max). "
        "`python benchmarks/adaptive_batch.py`",
        "",
        "| run | samples/s (median) | min-max | micro-batch per rank, last window |",
        "|---|---|---|---|",
        *(
            f"| {name} | {row['median']:.1f} | {row['min']:.1f}-{row['max']:.1f} | {row['micro_batch_per_rank']} |"
            for name, row in rows.items()
        ),
        "",
        f"With rank 1 slowed 2x, adaptive batches give **{adaptive['median'] / fixed['median']:.2f}x** the samples/s "
        f"of fixed ones ({adaptive['median'] / rows['clean, fixed']['median']:.2f}x of the clean run's; "
        f"fixed batches keep {fixed['median'] / rows['clean, fixed']['median']:.2f}x). On clean ranks adaptive "
        f"batches run at {rows['clean, adaptive']['median'] / rows['clean, fixed']['median']:.2f}x fixed ones.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settle", type=int, default=14, help="steps before the windows that are timed")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="micro-batch per rank with equal shares")
    parser.add_argument("--units", type=int, default=8, help="train.adaptive_batch_units")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()

    from mmpt.demo.digits import build_digits

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpt-adaptive-"))
    work.mkdir(parents=True, exist_ok=True)
    data = build_digits(work / "digits")
    runs: dict[str, list[dict]] = {name: [] for name in RUNS}
    for repeat in range(args.repeats):
        for name in RUNS:
            result = one_run(name, data, work, args)
            runs[name].append(result)
            print(f"repeat {repeat}: {name}: {json.dumps(result)}", flush=True)
    summary = {}
    for name, results in runs.items():
        values = [r["samples_per_s"] for r in results]
        summary[name] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "samples_per_s": values,
            "micro_batch_per_rank": results[-1]["micro_batch_per_rank"],
        }
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        **{key: getattr(args, key) for key in ("steps", "settle", "log_every", "batch", "units", "repeats")},
        "runs": summary,
    }
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "adaptive_batch.json").write_text(json.dumps(record, indent=2) + "\n")
    (results_dir / "adaptive_batch.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

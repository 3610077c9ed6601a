"""Rank health on clean runs: how often a healthy rank is named (a false report), over repeated runs.

Each run is one that `tests/test_health.py` injects its faults into, without a fault, in both of its layouts:
1 node x 2 CPU ranks (`deepspeed --num_gpus 2 launch/train.py`, 7 steps of 16 samples per rank) and 2 nodes x
2 ranks on this machine (one `torchrun --nnodes 2 --node_rank i` per node, 6 steps of 8 samples per rank). A
small clip model (ResNet-10t at 32 px, a 1-layer text transformer) on the digits corpus, ZeRO-2, a logging
window at every step, the default thresholds (`train.straggler_factor` 1.5, `train.slow_collective_factor`
2.0, `train.straggler_windows` 3, `train.unhealthy_min_share` 0.05). A run reports falsely when it names any
rank (`summary.json`'s stragglers or slow collectives, or an `unhealthy.json`). The worst busy-time and
return-lag ratios of each run (any rank's against its peers' median, over the windows after the first, as
the monitor judges them) show how close clean runs come to the thresholds.
Results: benchmarks/results/health_clean_runs.{json,md}.

    python benchmarks/health_clean_runs.py              # 10 runs of each layout, ~12 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from demo_runs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


# name: (nodes, ranks per node, steps, samples per rank), as tests/test_health.py runs them.
LAYOUTS = {"1 node x 2 ranks": (1, 2, 7, 16), "2 nodes x 2 ranks": (2, 2, 6, 8)}


def config(data: Path, run_dir: Path, steps: int, batch: int) -> dict:
    return {
        "extends": [str(REPO / "configs/base/zero2.yaml"), str(REPO / "configs/base/optim_adamw.yaml")],
        "method": {
            "name": "clip",
            "tokenizer": str(data / "tokenizer.json"),
            "embed_dim": 32,
            "image": {"timm_name": "resnet10t", "image_size": 32},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16, "dropout": 0.1},
            "zeroshot": {"dataset": None},
        },
        "data": {
            "train": {
                "sources": [{"shards": str(data / "train/en-*.tar")}, {"shards": str(data / "train/zh-*.tar")}],
                "batch_size": batch,
                "num_workers": 1,
                "shuffle_buffer": 100,
            }
        },
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"max_steps": steps, "log_every": 1, "save_every": 0},
        "run": {"output_dir": str(run_dir), "progress_bar": False, "tensorboard": False},
    }


def _against_peers(values: list[float], floor: float) -> float:
    """The largest ratio of one rank's figure to its peers' median."""
    return max(v / max(statistics.median(values[:r] + values[r + 1 :]), floor) for r, v in enumerate(values))


def worst_ratios(records: list[dict]) -> tuple[float, float]:
    """The largest busy-time and return-lag ratio of any rank to its peers', over the windows after the first."""
    busy, lag = 1.0, 1.0
    for record in records[1:]:
        if "busy_time_per_rank" not in record:
            continue
        busy = max(busy, _against_peers(record["busy_time_per_rank"], 1e-9))
        lag = max(lag, _against_peers(record["collective_return_lag_per_rank"], 1e-4))
    return busy, lag


def commands(nodes: int, per_node: int, path: Path) -> list[list[str]]:
    """One launcher per node; with 2 nodes, each is a torchrun meeting the other at 127.0.0.1."""
    port, script = str(free_port()), ["launch/train.py", "--config", str(path)]
    if nodes == 1:
        return [
            [
                str(Path(sys.executable).with_name("deepspeed")),
                "--num_gpus",
                str(per_node),
                "--master_port",
                port,
                *script,
            ]
        ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc_per_node",
        str(per_node),
    ]
    address = ["--master_addr", "127.0.0.1", "--master_port", port]
    return [[*torchrun, "--node_rank", str(node), *address, *script] for node in range(nodes)]


def one_run(data: Path, work: Path, layout: str, index: int) -> dict:
    nodes, per_node, steps, batch = LAYOUTS[layout]
    slug = f"{nodes}x{per_node}-run{index}"
    run_dir, path = work / slug, work / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(config(data, run_dir, steps, batch)))
    stale = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MMPT_INJECT_FAULT")
    env = {key: value for key, value in os.environ.items() if key not in stale}
    logs = [(work / f"{slug}-node{n}.log").open("w") for n in range(nodes)]
    launched = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        for c, log in zip(commands(nodes, per_node, path), logs)
    ]
    codes = [process.wait(timeout=900) for process in launched]
    for log in logs:
        log.close()
    if any(codes):
        tail = (work / f"{slug}-node{codes.index(max(codes))}.log").read_text()[-2000:]
        raise RuntimeError(f"{layout} run {index} exited with {codes}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    busy, lag = worst_ratios(records)
    named = {**summary["stragglers"], **summary["slow_collectives"]}
    return {
        "named": named,
        "unhealthy_json": (run_dir / "unhealthy.json").exists(),
        "worst_busy_ratio": round(busy, 3),
        "worst_return_lag_ratio": round(lag, 3),
    }


def summarise(runs: list[dict]) -> dict:
    return {
        "runs": len(runs),
        "false_reports": sum(1 for run in runs if run["named"] or run["unhealthy_json"]),
        "worst_busy_ratio": {
            "max": max(r["worst_busy_ratio"] for r in runs),
            "median": round(statistics.median(r["worst_busy_ratio"] for r in runs), 3),
        },
        "worst_return_lag_ratio": {
            "max": max(r["worst_return_lag_ratio"] for r in runs),
            "median": round(statistics.median(r["worst_return_lag_ratio"] for r in runs), 3),
        },
        "per_run": runs,
    }


def table(layout: str, result: dict) -> list[str]:
    *_, steps, batch = LAYOUTS[layout]
    return [
        f"## {layout}: {result['false_reports']} of {result['runs']} runs named a rank",
        "",
        f"{steps} steps of {batch} samples per rank.",
        "",
        "| run | ranks named | worst busy-time ratio (threshold 1.5, 3 windows in a row) | worst return-lag ratio (threshold 2.0) |",
        "|---|---|---|---|",
        *(
            f"| {i} | {run['named'] or 'none'} | {run['worst_busy_ratio']} | {run['worst_return_lag_ratio']} |"
            for i, run in enumerate(result["per_run"])
        ),
        "",
        f"At most {result['worst_busy_ratio']['max']}x the peers' median busy time (median run "
        f"{result['worst_busy_ratio']['median']}x) and {result['worst_return_lag_ratio']['max']}x their return lag "
        f"(median run {result['worst_return_lag_ratio']['median']}x).",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs of each layout")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()

    from mmpt.demo.digits import build_digits

    work = Path(tempfile.mkdtemp(prefix="mmpt-health-"))
    data = build_digits(work / "digits")
    layouts = {}
    for layout in args.layouts:
        runs = []
        for index in range(args.runs):
            runs.append(one_run(data, work, layout, index))
            print(f"{layout}, run {index}: {json.dumps(runs[-1])}", flush=True)
        layouts[layout] = summarise(runs)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "layouts": layouts,
    }
    false_reports = sum(result["false_reports"] for result in layouts.values())
    runs = sum(result["runs"] for result in layouts.values())
    lines = [
        "# Rank health on clean runs",
        "",
        f"{record['date']}, {record['machine']}; the fault tests' runs without their fault, a logging window per "
        "step, default thresholds. `python benchmarks/health_clean_runs.py`",
        "",
        f"**Runs that named a rank: {false_reports} of {runs}.** Even above a threshold a rank is named only when "
        "it stays there for `train.straggler_windows` windows in a row and it costs at least "
        "`train.unhealthy_min_share` of the window. With 2 nodes x 2 ranks, four processes share two cores: "
        "single windows do cross a threshold there, and it is the windows-in-a-row rule that keeps them from "
        "naming a rank.",
        "",
    ]
    for layout, result in layouts.items():
        lines += table(layout, result)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "health_clean_runs.json").write_text(json.dumps(record, indent=2) + "\n")
    (results / "health_clean_runs.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if false_reports == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

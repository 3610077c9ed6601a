"""Training throughput: mmpt vs open_clip's own trainer, same model, data, batch and transforms.

The model is an open_clip config (`benchmarks/configs/bench-vit-tiny.json`: ViT 6 x 256 at 64 px,
text 6 x 256, 22M parameters), trained from scratch in fp32 with AdamW on the digits corpus's
English shards (resampled), per-rank batch 32, one loader worker per rank, no gradient clipping,
global InfoNCE in its local-loss form. Runs:

- mmpt ZeRO-0 and ZeRO-2: `deepspeed --num_gpus N launch/train.py` with the `open_clip` method;
- open_clip: `torchrun --nproc_per_node N -m open_clip_train.main --local-loss --gather-with-grad`
  (through `benchmarks/open_clip_main.py`, which only registers the model config first).

Each configuration runs `--repeats` times, alternating; the first `--warmup` steps of a run are
dropped and a run's throughput is global batch / median step time (data wait included, as both
trainers time a step). OMP_NUM_THREADS = cores / ranks for both. Peak memory per rank is the
largest resident set of any rank process (loader workers excluded), polled every 0.2 s; mmpt also
reports the bytes its optimizer holds per rank (moments and fp32 master partitions), where ZeRO-2's
partitioning shows directly (resident sets include the framework's own buffers).
Results: benchmarks/results/train_throughput.{json,md,png}. The ratio mmpt/open_clip is printed last.

    python benchmarks/train_throughput.py              # ~7 minutes on 2 cores
    python benchmarks/train_throughput.py --repeats 1 --steps 20
    # only some trainers, results elsewhere (the headline ratio needs mmpt-zero0 and open_clip):
    python benchmarks/train_throughput.py --ranks 2 --only mmpt-zero0 mmpt-zero2 --results /tmp/tp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = REPO / "benchmarks" / "configs" / "bench-vit-tiny.json"
# open_clip's trainer needs webdataset<=0.2.86 (mmpt uses 1.x): kept in a directory of its own, put first on
# PYTHONPATH for the open_clip runs only; everything else (torch, open_clip) is the same installation.
OPEN_CLIP_DEPS = REPO / "benchmarks" / ".open_clip_train_deps"


def open_clip_deps() -> Path:
    if not (OPEN_CLIP_DEPS / "webdataset").is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(OPEN_CLIP_DEPS),
                "webdataset==0.2.86",
            ],
            check=True,
        )
    return OPEN_CLIP_DEPS


BATCH, LR, WD, WARMUP_LR_STEPS = 32, 1e-4, 0.1, 10
TRAINERS = ("mmpt-zero0", "mmpt-zero2", "open_clip")


class RankMemory:
    """Peak RSS of each rank process under `root` (a process whose parent is not itself a rank)."""

    def __init__(self, root: psutil.Process):
        self.root, self.peaks, self._stop = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                procs = self.root.children(recursive=True)
            except psutil.Error:
                break
            for proc in procs:
                try:
                    if "LOCAL_RANK" in proc.environ() and "LOCAL_RANK" not in proc.parent().environ():
                        self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), proc.memory_info().rss)
                except psutil.Error:
                    continue
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peaks.values(), default=0) / 2**20


def run(command: list[str], env: dict, log: Path, cwd: Path = REPO) -> float:
    with log.open("w") as out:
        process = psutil.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        memory = RankMemory(process)
        code = process.wait()
        peak = memory.stop()
    if code != 0:
        raise RuntimeError(f"{command[0]} exited with {code}; see {log}")
    return peak


def mmpt_run(ranks: int, zero: int, steps: int, data: Path, work: Path, env: dict) -> tuple[list[float], float, float]:
    run_dir = work / f"mmpt-z{zero}-{ranks}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {
        "method": {"name": "open_clip", "model": str(MODEL), "zeroshot": {"dataset": None}},
        "data": {
            "train": {
                "sources": [{"shards": str(data / "train/en-*.tar")}],
                "mode": "resampled",
                "batch_size": BATCH,
                "num_workers": 1,
                "shuffle_buffer": 1000,
            }
        },
        "optim": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.98], "eps": 1e-6, "warmup_steps": WARMUP_LR_STEPS},
        "train": {
            "max_steps": steps,
            "grad_clip": 0.0,
            "precision": "fp32",
            "zero_stage": zero,
            "log_every": 1,
            "save_every": 0,
            "seed": 0,
            "watchdog_timeout": 0,
        },
        "run": {"output_dir": str(run_dir), "resume": "none", "tensorboard": False, "progress_bar": False},
    }
    path = work / f"mmpt-z{zero}-{ranks}.yaml"
    path.write_text(yaml.safe_dump(config))
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    peak = run(
        [
            launcher,
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(_free_port()),
            "launch/train.py",
            "--config",
            str(path),
        ],
        env,
        work / f"mmpt-z{zero}-{ranks}.log",
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [max(r["step_time_per_rank"]) for r in records if "step_time_per_rank" in r]
    state = max(records[-1].get("optimizer_state_mib_per_rank") or [float("nan")])
    return times, peak, state


def open_clip_run(ranks: int, steps: int, data: Path, work: Path, env: dict) -> tuple[list[float], float, float]:
    name = f"open_clip-{ranks}"
    shutil.rmtree(work / "logs" / name, ignore_errors=True)
    shards = sorted((data / "train").glob("en-*.tar"))
    pattern = f"{data / 'train'}/en-{{{shards[0].stem[3:]}..{shards[-1].stem[3:]}}}.tar"
    args = [
        "--train-data",
        pattern,
        "--dataset-type",
        "webdataset",
        "--dataset-resampled",
        "--train-num-samples",
        str(steps * BATCH * ranks),
        "--epochs",
        "1",
        "--batch-size",
        str(BATCH),
        "--workers",
        "1",
        "--model",
        MODEL.stem,
        "--lr",
        str(LR),
        "--wd",
        str(WD),
        "--beta1",
        "0.9",
        "--beta2",
        "0.98",
        "--eps",
        "1e-6",
        "--warmup",
        str(WARMUP_LR_STEPS),
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--local-loss",
        "--gather-with-grad",
        "--log-every-n-steps",
        "1",
        "--save-frequency",
        "0",
        "--report-to",
        "",
        "--name",
        name,
        "--seed",
        "0",
    ]
    # open_clip writes to ./logs/<name>: run it in the scratch directory (torchrun would take --logs as its own)
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(open_clip_deps()), env.get("PYTHONPATH")]))}
    launcher = str(Path(sys.executable).with_name("torchrun"))
    peak = run(
        [
            launcher,
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(_free_port()),
            str(REPO / "benchmarks/open_clip_main.py"),
            *args,
        ],
        env,
        work / f"{name}.log",
        cwd=work,
    )
    text = (work / "logs" / name / "out.log").read_text()
    times = [float(t) for t in re.findall(r"Batch \(t\): ([0-9.]+)", text)]
    return times, peak, float("nan")  # its optimizer state is not reported


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarise(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run not timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument(
        "--only", nargs="+", choices=TRAINERS, default=list(TRAINERS), help="run only these trainers (default: all)"
    )
    parser.add_argument(
        "--results",
        default=str(RESULTS),
        help="directory for train_throughput.{json,md,png} (default: benchmarks/results)",
    )
    args = parser.parse_args()
    # ZeRO-2 on one rank partitions nothing, but runs DeepSpeed's ZeRO-2 code path (flat buffers, buckets).
    configs = [(name, ranks) for ranks in args.ranks for name in TRAINERS if name in args.only]

    from mmpt.demo.digits import build_digits

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = build_digits(work / "digits")
    cores = os.cpu_count() or 1
    samples: dict[str, list[float]] = {}
    memory: dict[str, list[float]] = {}
    optimizer_state: dict[str, float] = {}
    for repeat in range(args.repeats):
        for name, ranks in configs:
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // ranks)), "PYTHONUNBUFFERED": "1"}
            env.pop("RANK", None), env.pop("WORLD_SIZE", None)
            if name == "open_clip":
                times, peak, state = open_clip_run(ranks, args.steps, data, work, env)
            else:
                times, peak, state = mmpt_run(ranks, int(name[-1]), args.steps, data, work, env)
            timed = times[args.warmup :]
            key = f"{name} x{ranks}"
            throughput = BATCH * ranks / statistics.median(timed)
            samples.setdefault(key, []).append(throughput)
            memory.setdefault(key, []).append(peak)
            optimizer_state[key] = state
            print(
                f"repeat {repeat}: {key}: {throughput:.1f} samples/s over {len(timed)} steps, peak rank RSS "
                f"{peak:.0f} MiB",
                flush=True,
            )

    record = _record(samples, memory, optimizer_state, args, cores)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "train_throughput.json").write_text(json.dumps(record, indent=2) + "\n")
    (results / "train_throughput.md").write_text(_markdown(record))
    _plot(record, results / "train_throughput.png")
    print(_markdown(record))
    for key, ratio in record["ratios"].items():
        print(f"mmpt (ZeRO-0) / open_clip at {key[1:]} rank(s): {ratio:.3f}x samples/s")
    return 0


def _record(samples, memory, optimizer_state, args, cores) -> dict:
    import deepspeed
    import open_clip
    import torch

    ratios = {
        f"x{r}": statistics.median(samples[f"mmpt-zero0 x{r}"]) / statistics.median(samples[f"open_clip x{r}"])
        for r in args.ranks
        if f"mmpt-zero0 x{r}" in samples and f"open_clip x{r}" in samples
    }
    ratios_zero2 = {
        f"x{r}": statistics.median(samples[f"mmpt-zero2 x{r}"]) / statistics.median(samples[f"open_clip x{r}"])
        for r in args.ranks
        if f"mmpt-zero2 x{r}" in samples and f"open_clip x{r}" in samples
    }
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {cores} cores, CPU only",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "open_clip": open_clip.__version__,
        },
        "setup": {
            "model": MODEL.name,
            "batch_per_rank": BATCH,
            "steps": args.steps,
            "timed_from_step": args.warmup + 1,
            "repeats": args.repeats,
            "precision": "fp32",
        },
        "samples_per_s": {k: {**summarise(v), "runs": v} for k, v in samples.items()},
        "peak_rank_rss_mib": {k: {**summarise(v), "runs": v} for k, v in memory.items()},
        "optimizer_state_mib_per_rank": optimizer_state,
        "ratios": ratios,
        "ratios_zero2": ratios_zero2,
    }


def _markdown(record: dict) -> str:
    lines = [
        "# Training throughput: mmpt vs open_clip's trainer\n",
        f"{record['date']}, {record['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        + f". Model `{record['setup']['model']}`, batch {record['setup']['batch_per_rank']} per rank, "
        f"{record['setup']['precision']}, {record['setup']['repeats']} runs each (alternating), steps "
        f"{record['setup']['timed_from_step']}-{record['setup']['steps']} timed. "
        "Produced by `benchmarks/train_throughput.py`.\n",
        "| trainer x ranks | samples/s min | median | max | peak RSS per rank (MiB) min | median | max "
        "| optimizer state per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in record["samples_per_s"].items():
        m = record["peak_rank_rss_mib"][key]
        state = record["optimizer_state_mib_per_rank"][key]
        lines.append(
            f"| {key} | {s['min']:.1f} | {s['median']:.1f} | {s['max']:.1f} | {m['min']:.0f} | "
            f"{m['median']:.0f} | {m['max']:.0f} | {'n/a' if state != state else f'{state:.1f}'} |"
        )
    lines.append("")
    lines += [f"mmpt (ZeRO-2) / open_clip, {k}: {v:.3f}x" for k, v in record.get("ratios_zero2", {}).items()]
    lines += [f"mmpt (ZeRO-0) / open_clip, {k}: **{v:.3f}x**" for k, v in record["ratios"].items()]
    return "\n".join(lines) + "\n"


def _plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(record["samples_per_s"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, field, label in (
        (axes[0], "samples_per_s", "samples/s (median, min-max)"),
        (axes[1], "peak_rank_rss_mib", "peak RSS per rank, MiB"),
    ):
        values = record[field]
        medians = [values[k]["median"] for k in keys]
        errors = [
            [m - values[k]["min"] for k, m in zip(keys, medians)],
            [values[k]["max"] - m for k, m in zip(keys, medians)],
        ]
        colors = ["tab:orange" if k.startswith("open_clip") else "tab:blue" for k in keys]
        ax.bar(range(len(keys)), medians, yerr=errors, color=colors, capsize=3)
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

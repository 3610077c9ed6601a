"""Training runs of the suite: mmpt through launch/train.py, open_clip through its own trainer, both under
`probe.py`, and the step times read back from what each trainer logs.

On the GPU every run is a process of its own (an out-of-memory or a hang ends that run only, and its
peak memory is its own); the CPU dry run keeps mmpt runs in the calling process, which saves the
imports of a process start per run. open_clip's trainer always runs apart: it needs webdataset 0.2
where mmpt reads its shards with webdataset 1.x.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("probe.py")
TRAIN = REPO / "launch" / "train.py"
OPEN_CLIP_MAIN = REPO / "benchmarks" / "open_clip_main.py"
# Rendezvous variables of this process must not leak into a run's: each run is a world of its own.
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# run.sh installs open_clip_train's webdataset 0.2 here; without it, the CPU copy of train_throughput.py is used.
OPEN_CLIP_PATH_VARIABLE = "MMPT_OPEN_CLIP_TRAIN_PATH"


@dataclass
class Run:
    """One training run: the entry point, its arguments, and where its step log lands."""

    name: str
    script: Path
    args: list[str]
    log_dir: Path  # mmpt: the run directory (metrics.jsonl); open_clip: logs/<name> (out.log)
    mmpt: bool
    global_batch: int
    facts: dict[str, Any] = field(default_factory=dict)  # settings reported beside the figures
    profile: tuple[int, int] | None = None  # (first step, steps) under torch.profiler: mmpt runs only


def benchmark_settings(run_dir: Path, steps: int) -> dict[str, Any]:
    """What every mmpt benchmark run sets: its step count, a log line per step, nothing else written."""
    return {
        "train": {"max_steps": steps, "log_every": 1, "save_every": 0, "watchdog_timeout": 0},
        "run": {"output_dir": str(run_dir), "resume": "none", "tensorboard": False, "progress_bar": False},
    }


def deep_update(base: dict, top: dict) -> dict:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


def mmpt_run(
    name: str, work: Path, config: dict, steps: int, global_batch: int, overrides: dict | None = None, **facts: Any
) -> Run:
    """A run of `config` (a config mapping; `extends` may name a shipped config) for `steps` steps; `overrides`
    go over the benchmark's own settings (`benchmark_settings`)."""
    run_dir = work / "runs" / slug(name)
    config = deep_update(deep_update(copy.deepcopy(config), benchmark_settings(run_dir, steps)), overrides or {})
    path = work / "configs" / f"{slug(name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False))
    return Run(name, TRAIN, ["--config", str(path)], run_dir, True, global_batch, facts)


def open_clip_run(name: str, work: Path, args: list[str], global_batch: int, **facts: Any) -> Run:
    logs = work / "open_clip_logs"
    return Run(
        name,
        OPEN_CLIP_MAIN,
        [*args, "--logs", str(logs), "--name", slug(name)],
        logs / slug(name),
        False,
        global_batch,
        facts,
    )


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


class Runner:
    """Runs `Run`s under the probe and returns the probe's record with the trainer's step times."""

    def __init__(self, work: Path, isolate: bool):
        self.work, self.isolate = work, isolate
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(self, run: Run, timeout: float, warmup: int | None) -> dict[str, Any]:
        """`run` under the probe within `timeout` seconds; its logged steps after `warmup` summarised (None: a
        profiled run, whose one logged window holds its warm-up too, is not summarised)."""
        if run.log_dir.exists():
            shutil.rmtree(run.log_dir)  # open_clip refuses an existing experiment; mmpt would resume
        if self.isolate or not run.mmpt:
            record = self._in_own_process(run, timeout)
        else:
            from probe import StepProfiler, run_entry

            trace = self.logs / f"{slug(run.name)}.trace.json.gz"
            profile = StepProfiler(*run.profile, trace) if run.profile else None
            record = run_entry(str(run.script), run.args, mmpt=True, profile=profile)
        record = {"name": run.name, "global_batch": run.global_batch, **run.facts, **record}
        if warmup is None:
            return record
        if record["status"] == "ok":
            try:
                steps = mmpt_steps(run.log_dir) if run.mmpt else open_clip_steps(run.log_dir)
            except FileNotFoundError as exc:
                steps, record["error"] = [], f"no step log: {exc}"
            if not steps:
                record["status"] = "error"
                record["error"] = record["error"] or f"no step was logged (see {self.logs})"
            else:
                record.update(summarise_steps(steps, warmup, run.global_batch))
        elif record["status"] == "timeout":  # stopped at its share of the time: the steps it logged still count
            try:
                steps = mmpt_steps(run.log_dir) if run.mmpt else open_clip_steps(run.log_dir)
            except FileNotFoundError:
                steps = []
            if len(steps) > warmup:
                record.update(summarise_steps(steps, warmup, run.global_batch), partial=True)
        return record

    def _in_own_process(self, run: Run, timeout: float) -> dict[str, Any]:
        result = self.logs / f"{slug(run.name)}.json"
        log = self.logs / f"{slug(run.name)}.log"
        result.unlink(missing_ok=True)
        command = [
            sys.executable,
            str(PROBE),
            str(result),
            *(["--mmpt"] if run.mmpt else []),
            *(["--profile", ",".join(map(str, run.profile))] if run.profile else []),
            "--",
            str(run.script),
            *run.args,
        ]
        with log.open("w") as out:
            process = subprocess.Popen(command, cwd=REPO, env=self._env(run), stdout=out, stderr=subprocess.STDOUT)
            try:
                process.wait(timeout=max(1.0, timeout))
            except BaseException as exc:  # its share of the time is up, or the stage's (the suite's alarm)
                kill_tree(process)
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
                return {
                    "status": "timeout",
                    "wall_s": timeout,
                    "error": f"stopped after {timeout:.0f} s (its share of the stage's time)",
                }
        if not result.is_file():
            return {"status": "error", "error": f"exited with {process.returncode}: {tail(log)}"}
        record = json.loads(result.read_text())
        if record["status"] == "error":
            record["error"] = f"{record['error']} | log: {tail(log)}"
        return record

    def _env(self, run: Run) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
        env["PYTHONUNBUFFERED"] = "1"
        if not run.mmpt:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [open_clip_train_path(), env.get("PYTHONPATH")]))
        return env


def kill_tree(process: subprocess.Popen) -> None:
    """Kill a process and every process under it (loader workers, a stage's training runs), then reap it."""
    import psutil

    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:  # listed before any is killed: an orphan would leave the tree
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def open_clip_train_path() -> str:
    """Where open_clip_train's webdataset 0.2 is: run.sh's folder on the GPU, else the CPU benchmark's copy."""
    if os.environ.get(OPEN_CLIP_PATH_VARIABLE):
        return os.environ[OPEN_CLIP_PATH_VARIABLE]
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    from benchmarks.train_throughput import open_clip_deps

    return str(open_clip_deps())


def tail(log: Path, lines: int = 6) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return " / ".join(line.strip() for line in text[-lines:] if line.strip())[-800:]


def mmpt_steps(run_dir: Path) -> list[dict[str, float]]:
    """Per logged step (logged every step): step, data and forward seconds of rank 0, as the trainer reports them."""
    steps = []
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    for index, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:  # a run killed while writing its last line
                break
            raise
        if "step_time_per_rank" in record:
            steps.append(
                {
                    "step_s": record["step_time_per_rank"][0],
                    "data_s": record["data_time_per_rank"][0],
                    "forward_s": record["forward_time_per_rank"][0],
                }
            )
    return steps


def open_clip_steps(log_dir: Path) -> list[dict[str, float | None]]:
    """Per logged step: open_clip's `Data (t)` and `Batch (t)` (batch time includes data time)."""
    text = (log_dir / "out.log").read_text()
    return [
        {"step_s": float(b), "data_s": float(d), "forward_s": None}
        for d, b in re.findall(r"Data \(t\): ([0-9.]+) Batch \(t\): ([0-9.]+)", text)
    ]


def summarise_steps(steps: list[dict], warmup: int, global_batch: int) -> dict[str, Any]:
    """Medians over the steps after `warmup` (the last step if there are no more); samples/s = global batch /
    median step time."""
    timed = steps[warmup:] or steps[-1:]

    def median(key: str) -> float | None:
        values = [s[key] for s in timed if s[key] is not None]
        return statistics.median(values) if values else None

    step = median("step_s")
    forward = median("forward_s")
    return {
        "steps_logged": len(steps),
        "steps_timed": len(timed),
        "step_s": step,
        "step_s_min": min(s["step_s"] for s in timed),
        "step_s_max": max(s["step_s"] for s in timed),
        "data_s": median("data_s"),
        "compute_s": statistics.median(s["step_s"] - s["data_s"] for s in timed),
        "forward_s": forward,
        "backward_optimizer_s": None
        if forward is None
        else statistics.median(s["step_s"] - s["data_s"] - s["forward_s"] for s in timed),
        "samples_per_s": global_batch / step if step else None,
    }

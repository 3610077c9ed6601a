"""What the benchmarks share: where results go and how they are written, the spread of repeated runs, and
training a demo as a new user does (the deepspeed launcher on 2 CPU ranks in a fresh directory, which builds
the corpus, with dotted overrides)."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def summary(values: list[float]) -> dict[str, float]:
    """min, median and max of repeated runs."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def cells(spread: dict[str, float], digits: int = 0) -> str:
    """A summary's min | median | max as table cells."""
    return " | ".join(f"{spread[key]:.{digits}f}" for key in ("min", "median", "max"))


def machine_line(cores: str, **versions: str) -> str:
    """The date, the CPU and `cores`, then Python, torch and `versions`: a report's first words."""
    import platform

    import torch

    named = {"python": sys.version.split()[0], "torch": torch.__version__, **versions}
    cpu = platform.processor() or platform.machine()
    return f"{time.strftime('%Y-%m-%d')}, {cpu}, {cores}; " + ", ".join(f"{k} {v}" for k, v in named.items())


def save_results(name: str, record: Any, lines: list[str], folder: Path = RESULTS) -> None:
    """`<name>.json` (every figure) and `<name>.md` (the report `lines`) in `folder`; the report printed too."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_demo(config: str, run: str, overrides: list[str]) -> tuple[float, list[dict]]:
    """(launcher wall seconds, the run's metrics.jsonl records) of `config` trained with `overrides`."""
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    command = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "launch/train.py")]
    command += ["--config", str(REPO / config), "run.progress_bar=false", *overrides]
    with tempfile.TemporaryDirectory() as cwd:
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        lines = (Path(cwd) / run / "metrics.jsonl").read_text().splitlines()
    return seconds, [json.loads(line) for line in lines]

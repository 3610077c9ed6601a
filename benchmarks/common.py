"""Training a demo as a new user does, for the demo benchmarks: the deepspeed launcher on 2 CPU ranks
in a fresh directory (which builds the corpus), with dotted overrides."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_demo(config: str, run: str, overrides: list[str]) -> tuple[float, list[dict]]:
    """(launcher wall seconds, the run's metrics.jsonl records) of `config` trained with `overrides`."""
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    with tempfile.TemporaryDirectory() as cwd:
        started = time.perf_counter()
        subprocess.run(
            [
                launcher,
                "--num_gpus",
                "2",
                "--master_port",
                str(free_port()),
                str(REPO / "launch/train.py"),
                "--config",
                str(REPO / config),
                "run.progress_bar=false",
                *overrides,
            ],
            cwd=cwd,
            check=True,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
        lines = (Path(cwd) / run / "metrics.jsonl").read_text().splitlines()
    return seconds, [json.loads(line) for line in lines]

"""Run a training command and restart it from its latest checkpoint when it fails.

    python launch/supervise.py --max-restarts 3 -- deepspeed --num_gpus 8 launch/train.py --config c.yaml
    python launch/supervise.py --run-dir runs/x -- deepspeed --hostfile hosts launch/train.py --config c.yaml

The command must resume by itself (`run.resume: auto`, the default), so each restart continues
from the newest complete checkpoint. Config errors (exit code 2) are not retried.

A run that stopped on an unhealthy rank (`train.on_unhealthy: stop`, exit code 76) left
`<run dir>/unhealthy.json` naming the rank's node. With `--run-dir`, the restart leaves that node out:
a DeepSpeed launcher command given a `--hostfile` gets `--exclude` with every node named so far, and
any command finds them in the MMPT_EXCLUDED_NODES environment variable (comma-separated), for a
launch script of its own. The report is moved aside (`unhealthy-<restart>.json`) once read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIG_ERROR = 2
EXCLUDED_ENV = "MMPT_EXCLUDED_NODES"
UNHEALTHY_FILE = "unhealthy.json"  # as mmpt.engine.resilience.health writes it


def say(line: str) -> None:
    print(f"supervise: {line}", file=sys.stderr, flush=True)


def unhealthy_nodes(run_dir: Path, restart: int) -> list[str]:
    """The nodes a stop on an unhealthy rank named (none for a report that only warned); moves the report aside."""
    report_path = run_dir / UNHEALTHY_FILE
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        return []
    if report.get("action") != "stop":
        return []
    report_path.replace(run_dir / f"unhealthy-{restart}.json")
    for rank in report.get("ranks", []):
        say(f"unhealthy rank: {rank.get('line', rank)}")
    return list(report.get("nodes", []))


def without_nodes(command: list[str], nodes: list[str]) -> list[str]:
    """`command`, told to leave `nodes` out where it can be: a DeepSpeed launcher with a hostfile."""
    if not nodes or Path(command[0]).name != "deepspeed" or not any(a.startswith("--hostfile") for a in command):
        return command
    return [command[0], f"--exclude={'@'.join(nodes)}", *command[1:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--delay", type=float, default=5.0, help="seconds to wait before a restart")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="the run's output_dir: restart without the nodes it names unhealthy"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")
    excluded: list[str] = []
    for attempt in range(args.max_restarts + 1):
        env = {**os.environ, EXCLUDED_ENV: ",".join(excluded)} if excluded else None
        code = subprocess.call(without_nodes(command, excluded), env=env)
        if code in (0, CONFIG_ERROR):
            return code
        if args.run_dir is not None:
            excluded += [node for node in unhealthy_nodes(args.run_dir, attempt) if node not in excluded]
        if attempt == args.max_restarts:
            say(f"the run failed with exit code {code} after {attempt} restart(s); giving up")
            return code
        leaving_out = f" without node(s) {','.join(excluded)}" if excluded else ""
        say(
            f"the run failed with exit code {code}; restart {attempt + 1} of {args.max_restarts} "
            f"from the latest checkpoint{leaving_out}"
        )
        time.sleep(args.delay)
    return 1

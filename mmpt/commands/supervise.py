"""Run a training command and restart it from its latest checkpoint when it fails.

    python launch/supervise.py --max-restarts 3 -- deepspeed --num_gpus 8 launch/train.py --config c.yaml

The command must resume by itself (`run.resume: auto`, the default), so each restart continues
from the newest complete checkpoint. Config errors (exit code 2) are not retried.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CONFIG_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--delay", type=float, default=5.0, help="seconds to wait before a restart")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the training command after --")
    for attempt in range(args.max_restarts + 1):
        code = subprocess.call(command)
        if code in (0, CONFIG_ERROR):
            return code
        if attempt == args.max_restarts:
            print(
                f"supervise: the run failed with exit code {code} after {attempt} restart(s); giving up",
                file=sys.stderr,
                flush=True,
            )
            return code
        print(
            f"supervise: the run failed with exit code {code}; restart {attempt + 1} of {args.max_restarts} "
            "from the latest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(args.delay)
    return 1

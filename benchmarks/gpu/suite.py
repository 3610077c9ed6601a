"""The GPU benchmark suite: mmpt's methods on one GPU, each stage under a time cap, all in a fixed budget.

    python benchmarks/gpu/suite.py                    # on the GPU machine (bash benchmarks/gpu/run.sh does this)
    python benchmarks/gpu/suite.py --only clip_vitb16,nccl --budget 540
    python benchmarks/gpu/suite.py --dry-run --output-dir /tmp/gpu-dry   # CPU, tiny shapes, about a minute
    python benchmarks/gpu/suite.py --merge a/gpu.json b/gpu.json       # one report from split runs

Stages (see stages.py): clip_vitb16, m2_encoder, loss_memory, victor, space2, nccl. On the GPU each stage
runs in a process of its own, killed at its cap (a hang or a broken CUDA context ends that stage only);
a stage that fails is recorded with its error and the suite goes on. A stage starts only if at least
MIN_STAGE_S of the budget is left, and gets no more than what is left.

Results: gpu.md and gpu.json in benchmarks/results/ (GPU runs; --output-dir elsewhere) and in $OUT when
it is set. The dry run writes to --output-dir (default: a new temporary folder), never to benchmarks/results/.
Exit status 0 when every stage ran ok.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_BUDGET_S = 1380.0  # 23 minutes of a 25-minute slot: wheels, corpora and start-up take the rest
MIN_STAGE_S = 45.0
GRACE_S = 30.0  # beyond a stage's cap before its process is killed: it stops its own runs at the cap
DRY_STAGE_S = 240.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    from stages import STAGES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 1-2 steps per run")
    parser.add_argument("--only", default=",".join(STAGES), help="comma-separated stages (default: all)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all stages together")
    parser.add_argument("--output-dir", type=Path, default=None, help="where gpu.md and gpu.json go")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (corpora, runs, logs)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="gpu.json files to merge into one report")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="with --dry-run: the GPU's process layout (a process per stage and per run); slower",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run these stages here
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    return args


# ----------------------------------------------------------------------------- the machine


def gpu_info() -> dict[str, str] | None:
    """Name, driver and memory of GPU 0 from nvidia-smi; None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    if query.returncode or not query.stdout.strip():
        return None
    name, driver, memory = (part.strip() for part in query.stdout.splitlines()[0].split(","))
    return {"name": name, "driver": driver, "memory_total": memory}


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    import torch
    from stages import nccl_version

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": gpu_info(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "nccl": nccl_version(),
            **{
                name: version(name)
                for name in (
                    "deepspeed",
                    "open_clip_torch",
                    "transformers",
                    "timm",
                    "webdataset",
                    "pydantic",
                    "av",
                    "decord",
                )
            },
        },
    }


# ----------------------------------------------------------------------------- stages in worker processes


def run_worker(names: list[str], context_file: Path) -> int:
    """Run `names` one after another in this process, each until its own deadline; one result file per stage."""
    import stages
    import torch.distributed as dist
    from training import Runner

    context = json.loads(context_file.read_text())
    profile = stages.DRY if context["dry_run"] else stages.GPU
    work = Path(context["work"])
    runner = Runner(work, isolate=context["isolate"])
    for name in names:
        started = time.monotonic()
        ctx = stages.Context(profile, work, started + context["caps"][name], runner)
        outcome: dict[str, Any] = {"status": "ok", "error": None, "results": None}
        try:
            print(f"stage {name}: started", flush=True)
            results = stages.STAGES[name](ctx)
            outcome["results"] = results
            if results.get("errors"):
                outcome.update(status="failed", error="; ".join(results["errors"]))
        except Exception as exc:  # recorded; the next stage still runs
            traceback.print_exc()
            outcome.update(status="failed", error=" ".join(f"{type(exc).__name__}: {exc}".split())[:1000])
        outcome.update(seconds=time.monotonic() - started, cap_s=context["caps"][name])
        (work / "results" / f"{name}.json").write_text(json.dumps(outcome, indent=1, default=str))
        print(f"stage {name}: {outcome['status']} in {outcome['seconds']:.0f} s", flush=True)
    if dist.is_initialized():  # a stage's process group of one, or the in-process runs' (dry run)
        dist.destroy_process_group()
    return 0


def launch(names: list[str], caps: dict[str, float], work: Path, dry_run: bool, isolate: bool) -> dict[str, dict]:
    """One worker process for `names`; its results, or a failure for each stage it left without one."""
    from training import kill_tree

    context = work / f"context-{'-'.join(names)}.json"
    context.write_text(json.dumps({"dry_run": dry_run, "isolate": isolate, "work": str(work), "caps": caps}))
    log = work / "logs" / f"stage-{'-'.join(names)}.log"
    timeout = sum(caps[n] for n in names) + GRACE_S
    for name in names:
        (work / "results" / f"{name}.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:  # tiny shapes: torch's thread pool only spins against the other processes of a small machine
        env.setdefault("OMP_NUM_THREADS", "1")
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "suite.py"), "--worker", ",".join(names), "--context", str(context)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            code = process.wait(timeout=timeout)
            why = f"its process exited with {code} before writing a result"
        except subprocess.TimeoutExpired:
            kill_tree(process)  # the stage's training runs too: they must not hold the GPU for the next stage
            why = f"timed out: stopped after {timeout:.0f} s (cap {timeout - GRACE_S:.0f} s)"
    outcomes = {}
    for name in names:
        result = work / "results" / f"{name}.json"
        outcomes[name] = (
            json.loads(result.read_text())
            if result.is_file()
            else {
                "status": "failed",
                "error": f"{why}; log {log}: {log_tail(log)}",
                "results": None,
                "cap_s": caps[name],
            }
        )
    return outcomes


def log_tail(log: Path, lines: int = 8) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return " / ".join(line.strip() for line in text[-lines:] if line.strip())[-1200:]


def run_stages(names: list[str], budget: float, work: Path, dry_run: bool, isolate: bool) -> dict[str, dict]:
    """Isolated (the GPU): a process per stage, each capped and within the budget. Otherwise one process for all."""
    from stages import GPU_CAPS

    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    caps = dict.fromkeys(names, DRY_STAGE_S) if dry_run else GPU_CAPS
    if not isolate:
        return launch(names, caps, work, dry_run, isolate)
    outcomes, end = {}, time.monotonic() + budget
    for name in names:
        cap = min(caps[name], end - time.monotonic() - GRACE_S)
        if cap < MIN_STAGE_S:
            outcomes[name] = {"status": "skipped", "error": f"suite budget spent ({budget:.0f} s)", "results": None}
        else:
            outcomes.update(launch([name], {name: cap}, work, dry_run, isolate))
        print(
            f"stage {name}: {outcomes[name]['status']}"
            + (f" ({outcomes[name]['error']})" if outcomes[name]["error"] else ""),
            flush=True,
        )
    return outcomes


# ----------------------------------------------------------------------------- results


def output_dirs(requested: Path | None, dry_run: bool) -> list[Path]:
    first = requested or (Path(tempfile.mkdtemp(prefix="mmpt-gpu-dry-")) if dry_run else RESULTS)
    extra = [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
    return [first, *[d for d in extra if d.resolve() != first.resolve()]]


def write(record: dict, directories: list[Path]) -> None:
    from report import markdown

    text = markdown(record)
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "gpu.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (directory / "gpu.md").write_text(text)
        print(f"wrote {directory / 'gpu.md'} and gpu.json", flush=True)


def merge(files: list[Path]) -> dict:
    """One record from several runs' gpu.json (a later file's stage replaces an earlier one's)."""
    records = [json.loads(f.read_text()) for f in files]
    gpus = {json.dumps(r["environment"].get("gpu"), sort_keys=True) for r in records}
    if len(gpus) > 1:
        raise SystemExit(f"the files come from different machines ({', '.join(sorted(gpus))}): not merged")
    stages: dict[str, dict] = {}
    for record in records:
        stages.update(record["stages"])
    return {
        **records[0],
        "stages": stages,
        "merged_from": [str(f) for f in files],
        "dry_run": any(r.get("dry_run") for r in records),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker.split(","), args.context)
    if args.merge:
        record = merge(args.merge)
        write(record, output_dirs(args.output_dir or RESULTS, dry_run=False))
        return 0 if all(s["status"] == "ok" for s in record["stages"].values()) else 1

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: the suite measures GPUs (use --dry-run to check it on CPU)", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.gettempdir()) / ("mmpt-gpu-dry" if args.dry_run else "mmpt-gpu-bench")
    started = time.monotonic()
    record = {
        "suite": "benchmarks/gpu/suite.py",
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "environment": environment(),
        "stages": {},
    }
    record["stages"] = run_stages(args.only, args.budget, work, args.dry_run, isolate=args.isolate or not args.dry_run)
    record["seconds"] = time.monotonic() - started
    write(record, output_dirs(args.output_dir, args.dry_run))
    failed = [n for n, s in record["stages"].items() if s["status"] != "ok"]
    print(
        f"suite: {len(record['stages']) - len(failed)} of {len(record['stages'])} stages ok in "
        f"{record['seconds']:.0f} s" + (f"; not ok: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The GPU benchmark suite: mmpt's methods on one GPU, each stage under a time cap, grouped in commands that each
fit one remote call.

    python benchmarks/gpu/suite.py --plan                 # the commands to run on the GPU machine, in order
    bash benchmarks/gpu/run.sh --group 1                  # there: one command of the plan (runs this file)
    python benchmarks/gpu/suite.py --merge DIR_1 DIR_2 DIR_3   # here: one report from the folders that came back
    python benchmarks/gpu/suite.py --dry-run --output-dir /tmp/gpu-dry   # CPU, tiny shapes, about a minute

Stages (see stages.py): clip_vitb16, loss_memory, nccl, m2_encoder, clip_compile, data_loader, victor, space2.
On the GPU each stage runs in a process of its own. A stage has a cap (plan.py): at the cap an alarm stops it
where it is (whatever it measured so far is kept), a little later its process is killed (a hang in CUDA or a
broken context ends that stage only); either way it is recorded as timed_out and the suite goes on. A stage
that fails is recorded with its error. A stage starts only if at least MIN_STAGE_S of the budget is left
(with --group: what is left of the command's COMMAND_S since run.sh started), and gets no more than that.

Results (results.py): each stage writes stage-<name>.json into the output folders as it starts (`running`)
and as it ends, and gpu.md and gpu.json are rebuilt from the folder's stage files each time, so a command
killed from outside loses only the stage it was running. The folders: --output-dir, and $OUT when it is set;
by default $OUT on the GPU (benchmarks/results/gpu/ without it), a new temporary folder for the dry run, which
never writes to benchmarks/results/. Exit status 0 when every stage ran ok.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import plan
import results

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gpu"
MIN_STAGE_S = 45.0
GRACE_S = 30.0  # beyond a stage's cap before its process is killed; the alarm stops it at the cap
DRY_STAGE_S = 420.0  # a loaded CI machine: the dry run's caps catch hangs, not slowness
COMMAND_START_VARIABLE = "MMPT_GPU_COMMAND_START"  # run.sh: when the command started (seconds since the epoch)
STALL_VARIABLE = "MMPT_GPU_DRY_STALL"  # dry run only: "<stage>" hangs that stage, "<stage>:hard" ignoring alarms
WHEEL_MANIFEST = "manifest.json"


class StageTimeout(BaseException):
    """Raised in a stage when its cap is reached; a BaseException so that no stage's own handler takes it."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    from stages import STAGES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print the commands to run on the GPU machine")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 1-2 steps per run")
    parser.add_argument("--group", default=None, help="the stages of one command of the plan (plan.py)")
    parser.add_argument("--only", default=None, help="comma-separated stages (default: all)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all stages together")
    parser.add_argument(
        "--cap", default=None, help="SECONDS for every stage, or STAGE=SECONDS,... for some (default: plan.py's caps)"
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="where the stage files and gpu.md go")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (corpora, runs, logs)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="folders (or gpu.json files) to merge")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="with --dry-run: the GPU's process layout (a process per stage and per run); slower",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run these stages here
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group is not None and args.only is not None:
        parser.error("--group and --only choose the stages both: give one")
    try:
        args.only = list(plan.group(args.group).stages) if args.group else (args.only or ",".join(STAGES)).split(",")
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    args.only = [s for s in args.only if s]
    try:
        args.cap = parse_caps(args.cap, args.only)
    except ValueError:
        parser.error(f"--cap takes SECONDS or STAGE=SECONDS,...: {args.cap}")
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
        "wheels": wheel_manifest(),
    }


def wheel_manifest() -> dict[str, Any] | None:
    """What prepare_wheels.py recorded of the carried wheels (their versions, the image they were checked for)."""
    folder = Path(os.environ.get("MMPT_WHEELS") or REPO / ".whl")
    try:
        return json.loads((folder / WHEEL_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------- stages in worker processes


def outcome_base(context: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "run_id": context["run_id"],
        "group": context["group"],
        "dry_run": context["dry_run"],
        "cap_s": context["caps"][name],
        "environment": context["environment"],
    }


def run_worker(names: list[str], context_file: Path) -> int:
    """Run `names` one after another in this process, each until its cap; each one's record written as it starts
    and as it ends, the report rebuilt each time."""
    import stages
    import torch.distributed as dist
    from training import Runner

    context = json.loads(context_file.read_text())
    profile = stages.DRY if context["dry_run"] else stages.GPU
    work = Path(context["work"])
    folders = [Path(f) for f in context["outputs"]]
    order = list(stages.STAGES)
    runner = Runner(work, isolate=context["isolate"])
    for name in names:
        cap = context["caps"][name]
        started = time.monotonic()
        base = {**outcome_base(context, name), "started": utc_now()}
        results.record_stage(folders, name, {**base, "status": "running", "error": None, "results": None}, order)
        ctx = stages.Context(profile, work, started + cap, runner)
        outcome: dict[str, Any] = {**base, "status": "ok", "error": None, "results": None}
        print(f"stage {name}: started (cap {cap:.0f} s)", flush=True)
        try:
            with alarm_at(cap):
                stall_if_asked(name, context["dry_run"])
                found = stages.STAGES[name](ctx)
            outcome["results"] = found
            if found.get("errors"):
                outcome.update(status="failed", error="; ".join(found["errors"]))
        except StageTimeout:
            outcome.update(
                status="timed_out",
                error=f"stopped at its cap ({cap:.0f} s); what it measured before is kept",
                results=ctx.partial or None,
            )
        except Exception as exc:  # recorded; the next stage still runs
            traceback.print_exc()
            outcome.update(
                status="failed",
                error=" ".join(f"{type(exc).__name__}: {exc}".split())[:1000],
                results=ctx.partial or None,
            )
        outcome.update(seconds=time.monotonic() - started, finished=utc_now())
        results.record_stage(folders, name, outcome, order)
        for folder in folders:
            results.archive_logs(work, folder)
        print(f"stage {name}: {outcome['status']} in {outcome['seconds']:.0f} s", flush=True)
    if dist.is_initialized():  # a stage's process group of one, or the in-process runs' (dry run)
        dist.destroy_process_group()
    return 0


class alarm_at:
    """Raise StageTimeout in this (the main) thread after `seconds`; the timer is cleared on leaving."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self) -> None:
        def expire(signum: int, frame: Any) -> None:
            raise StageTimeout

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, self.seconds))

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def stall_if_asked(name: str, dry_run: bool) -> None:
    """The dry run's stand-in for a stage that hangs (STALL_VARIABLE): in Python, which the alarm stops, or, with
    `:hard`, deaf to the alarm like a hang inside CUDA, which only killing the process ends."""
    stage, _, how = os.environ.get(STALL_VARIABLE, "").partition(":")
    if not dry_run or stage != name:
        return
    if how == "hard":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    print(f"stage {name}: stalling ({STALL_VARIABLE})", flush=True)
    while True:
        time.sleep(0.5)


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def launch(names: list[str], caps: dict[str, float], work: Path, context: dict[str, Any]) -> dict[str, dict]:
    """One worker process for `names`, killed GRACE_S after their caps; the stages it left without a final record
    get one here (timed_out for the one it was running when killed)."""
    from training import kill_tree

    label = "-".join(names)
    context = {**context, "caps": caps}
    context_file = work / f"context-{label}.json"
    context_file.write_text(json.dumps(context, default=str))
    log = work / "logs" / f"stage-{label}.log"
    grace = grace_for(caps, names)
    timeout = sum(caps[n] for n in names) + grace
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if context["dry_run"]:  # tiny shapes: torch's thread pool only spins against the other processes of a small machine
        env.setdefault("OMP_NUM_THREADS", "1")
    killed = False
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "suite.py"), "--worker", ",".join(names), "--context", str(context_file)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)  # the stage's training runs too: they must not hold the GPU for the next stage
            killed, code = True, None
    folders = [Path(f) for f in context["outputs"]]
    order = context["order"]
    outcomes = {}
    for name in names:
        found = results.read_stages(folders[0]).get(name)
        if found is None or found.get("run_id") != context["run_id"]:
            found = {
                **outcome_base(context, name),
                "status": "skipped" if killed else "failed",
                "error": (
                    "not started: the stage before it was stopped"
                    if killed
                    else f"its process exited with {code} before starting it; log {log}: {log_tail(log)}"
                ),
                "results": None,
            }
            results.record_stage(folders, name, found, order)
        elif found["status"] == "running":
            found.update(
                status="timed_out" if killed else "failed",
                error=(
                    f"killed {grace:.0f} s after its cap ({caps[name]:.0f} s): it did not stop at the alarm"
                    if killed
                    else f"its process exited with {code} while it ran; log {log}: {log_tail(log)}"
                ),
                seconds=caps[name] + grace if killed else None,
                finished=utc_now(),
            )
            results.record_stage(folders, name, found, order)
        outcomes[name] = found
    for folder in folders:
        results.archive_logs(work, folder)
    return outcomes


def grace_for(caps: dict[str, float], names: list[str]) -> float:
    """GRACE_S, or less for short caps (the dry run's): the alarm comes at the cap, the kill this much later."""
    return min(GRACE_S, max(2.0, min(caps[n] for n in names)))


def log_tail(log: Path, lines: int = 8) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return " / ".join(line.strip() for line in text[-lines:] if line.strip())[-1200:]


def parse_caps(text: str | None, names: list[str]) -> dict[str, float]:
    """--cap: "SECONDS" for every stage, or "STAGE=SECONDS,..."."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(names, float(text))
    return {name: float(seconds) for name, seconds in (part.split("=") for part in text.split(","))}


def stage_caps(names: list[str], dry_run: bool, given: dict[str, float]) -> dict[str, float]:
    return {name: given.get(name) or (DRY_STAGE_S if dry_run else plan.CAPS[name]) for name in names}


def run_stages(
    names: list[str], end: float, work: Path, context: dict[str, Any], given: dict[str, float]
) -> dict[str, dict]:
    """Isolated (the GPU): a process per stage, each capped and within the budget. Otherwise one process for all."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    caps = stage_caps(names, context["dry_run"], given)
    if not context["isolate"]:
        return launch(names, caps, work, context)
    folders = [Path(f) for f in context["outputs"]]
    outcomes = {}
    for name in names:
        grace = grace_for(caps, [name])
        left = end - time.monotonic() - grace
        if min(caps[name], left) < min(MIN_STAGE_S, caps[name]):
            outcomes[name] = {
                **outcome_base({**context, "caps": caps}, name),
                "status": "skipped",
                "error": f"not started: {max(0.0, left):.0f} s of the budget left",
                "results": None,
            }
            results.record_stage(folders, name, outcomes[name], context["order"])
        else:
            outcomes.update(launch([name], {name: min(caps[name], left)}, work, context))
        print(
            f"stage {name}: {outcomes[name]['status']}"
            + (f" ({outcomes[name]['error']})" if outcomes[name]["error"] else ""),
            flush=True,
        )
    return outcomes


def budget_end(args: argparse.Namespace, names: list[str], started: float) -> float:
    """time.monotonic() by which the stages must be done: --group, what is left of the command (counted from
    run.sh's start when it says, else from now less SETUP_S); --budget; else the caps together."""
    ends = []
    if args.group:
        command_start = os.environ.get(COMMAND_START_VARIABLE)
        spent = time.time() - float(command_start) if command_start else plan.SETUP_S
        ends.append(started + plan.COMMAND_S - spent - plan.END_MARGIN_S)
    if args.budget is not None:
        ends.append(started + args.budget)
    if not ends:
        caps = stage_caps(names, args.dry_run, args.cap)
        ends.append(started + sum(caps.values()) + GRACE_S * len(names))
    return min(ends)


# ----------------------------------------------------------------------------- results


def output_dirs(requested: Path | None, dry_run: bool) -> list[Path]:
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    first = requested or (Path(tempfile.mkdtemp(prefix="mmpt-gpu-dry-")) if dry_run else out or RESULTS)
    extra = [out] if out is not None else []
    return [first, *[d for d in extra if d.resolve() != first.resolve()]]


def merge(paths: list[Path], into: Path, order: list[str]) -> dict:
    """One folder of stage files (a later path's stage replaces an earlier one's) and its report, from the
    folders the commands brought back (or their gpu.json files), with each folder's logs as logs-N.tar.gz."""
    stages: dict[str, dict] = {}
    for path in paths:
        if path.is_dir():
            stages.update(results.read_stages(path))
        else:
            record = json.loads(path.read_text())
            for name, stage in record["stages"].items():
                stages[name] = {"environment": record.get("environment"), "dry_run": record.get("dry_run"), **stage}
    if not stages:
        raise SystemExit(f"no stage files in {', '.join(map(str, paths))}")
    machines = {results.gpu_name(s.get("environment") or {}) for s in stages.values()}
    if len(machines) > 1:
        raise SystemExit(f"the stages come from different machines ({', '.join(sorted(machines))}): not merged")
    into.mkdir(parents=True, exist_ok=True)
    for name, stage in stages.items():
        results.write_atomic(results.stage_file(into, name), json.dumps(stage, indent=1, default=str) + "\n")
    for index, path in enumerate(paths, 1):  # each command's run logs and configs, beside the figures they back
        if (path / "logs.tar.gz").is_file():
            results.write_atomic(into / f"logs-{index}.tar.gz", (path / "logs.tar.gz").read_bytes())
    record = results.rebuild(into, order)
    print(f"wrote {into / 'gpu.md'} and gpu.json from {len(stages)} stage files", flush=True)
    return record


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from stages import STAGES

    order = list(STAGES)
    if args.plan:
        print(plan.describe())
        return 0
    if args.worker:
        return run_worker(args.worker.split(","), args.context)
    if args.merge:
        record = merge(args.merge, args.output_dir or RESULTS, order)
        return 0 if all(s["status"] == "ok" for s in record["stages"].values()) else 1

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: the suite measures GPUs (use --dry-run to check it on CPU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    end = budget_end(args, args.only, started)
    work = args.work or Path(tempfile.gettempdir()) / ("mmpt-gpu-dry" if args.dry_run else "mmpt-gpu-bench")
    work.mkdir(parents=True, exist_ok=True)
    folders = output_dirs(args.output_dir, args.dry_run)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    context = {
        "run_id": uuid.uuid4().hex,
        "group": args.group,
        "dry_run": args.dry_run,
        "isolate": args.isolate or not args.dry_run,
        "work": str(work),
        "outputs": [str(f) for f in folders],
        "order": order,
        "environment": environment(),
    }
    print(f"suite: {', '.join(args.only)} within {end - started:.0f} s; results in {', '.join(map(str, folders))}")
    outcomes = run_stages(args.only, end, work, context, args.cap)
    failed = [n for n, s in outcomes.items() if s["status"] != "ok"]
    print(
        f"suite: {len(outcomes) - len(failed)} of {len(outcomes)} stages ok in {time.monotonic() - started:.0f} s"
        + (f"; not ok: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

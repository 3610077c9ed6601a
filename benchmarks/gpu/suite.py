"""The GPU benchmark suite: mmpt's trainer on one GPU (against open_clip_train for ViT-B/16) and the loss-memory
sweep, each stage under a time cap, grouped in commands that each fit one remote call of at most 10 minutes.

    python benchmarks/gpu/suite.py --plan                      # the commands to run on the GPU machine, in order
    bash benchmarks/gpu/run.sh --group 1                       # there: one command of the plan (runs this file)
    python benchmarks/gpu/suite.py --merge DIR_1 DIR_2         # here: one report from the folders that came back
    python benchmarks/gpu/suite.py --dry-run --output-dir /tmp/gpu-dry   # CPU, tiny shapes, every stage

Each stage (stages.py) runs in a process of its own, killed at its cap: it is then recorded as timed_out with what
it measured before (each training run's record is written as the run ends), and the next stage runs; a stage that
fails is recorded with its error. A stage starts only if MIN_STAGE_S of the budget are left (with --group: what is
left of COMMAND_S since run.sh started), and gets no more than that.

Each stage writes stage-<name>.json into the output folders as it starts (`running`), after each run and as it
ends, every file written whole (a temporary name, then a rename); gpu.md and gpu.json are rebuilt from the folder's
stage files each time, and logs.tar.gz holds every run's log and config. A command killed from outside loses only
the stage it was running. The folders: --output-dir, and $OUT when it is set; by default $OUT on the GPU
(benchmarks/results/gpu/ without it), a new temporary folder for the dry run, which never writes to
benchmarks/results/. Exit status 0 when every stage ran ok.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gpu"
# A machine is lent for 15 minutes of device time, its start and the transfers included: the first command holds
# what matters most, the second follows at once on the machine still warm, where the lease has time left.
COMMAND_S = 560.0  # one command, installation and imports included (a call may run 600 s)
SETUP_S = 40.0  # wheels installed offline, the environment printed (26 s on an H100)
END_MARGIN_S = 15.0  # the last report and log archive
MIN_STAGE_S = 45.0
DRY_CAP_S = 600.0  # a loaded CI machine: the dry run's caps catch hangs, not slowness
CAPS = {  # seconds each stage may take on the GPU, corpus building included
    "clip_vitb16": 190,
    "m2_encoder": 235,
    "loss_memory": 40,
    "space2": 60,
    "victor": 70,
    "clip_compile": 200,  # the first compiled ViT-B/16 step took 54 s from a cold inductor cache on an H100
}
COMMANDS = {"1": ("clip_vitb16", "m2_encoder"), "2": ("loss_memory", "space2", "victor", "clip_compile")}
COMMAND_START_VARIABLE = "MMPT_GPU_COMMAND_START"  # run.sh: when the command started (seconds since the epoch)
STALL_VARIABLE = "MMPT_GPU_DRY_STALL"  # dry run only: this stage hangs (for the tests)
FINAL = ("ok", "failed", "timed_out", "skipped")


def describe() -> str:
    lines = ["Commands, in this order, each one remote call with `.whl` carried (timeout 600 s):"]
    for group, names in COMMANDS.items():
        seconds = sum(CAPS[n] for n in names) + SETUP_S + END_MARGIN_S
        budgets = ", ".join(f"{n} {CAPS[n]} s" for n in names)
        lines.append(f"  bash benchmarks/gpu/run.sh --group {group}    # {budgets}; {seconds:.0f} s with set-up")
    lines.append("Then, here: python benchmarks/gpu/suite.py --merge FOLDER_1 FOLDER_2    # -> benchmarks/results/gpu/")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- records on disk


def write_atomic(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    os.replace(temporary, path)


def read_stages(folder: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(folder.glob("stage-*.json")):
        try:
            found[path.stem.removeprefix("stage-")] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return found


def rebuild(folder: Path) -> dict[str, Any]:
    """gpu.json and gpu.md of `folder` from its stage files, as they are now."""
    from report import markdown

    stages = read_stages(folder)
    ordered = {name: stages[name] for name in CAPS if name in stages}
    environments = [s["environment"] for s in ordered.values() if s.get("environment")]
    record = {
        "suite": "benchmarks/gpu/suite.py",
        "dry_run": any(s.get("dry_run") for s in ordered.values()),
        "environment": environments[0] if environments else {},
        "stages": ordered,
    }
    write_atomic(folder / "gpu.json", json.dumps(record, indent=1, default=str) + "\n")
    write_atomic(folder / "gpu.md", markdown(record))
    return record


def record_stage(folders: list[Path], name: str, record: dict[str, Any]) -> None:
    for folder in folders:
        write_atomic(folder / f"stage-{name}.json", json.dumps(record, indent=1, default=str) + "\n")
        rebuild(folder)


def archive_logs(work: Path, folder: Path) -> None:
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".logs.tar.gz.")
    os.close(handle)
    with tarfile.open(temporary, "w:gz") as archive:
        for part in ("logs", "configs"):
            if (work / part).exists():
                archive.add(work / part, arcname=part)
    os.replace(temporary, folder / "logs.tar.gz")


# ----------------------------------------------------------------------------- the machine


def environment() -> dict[str, Any]:
    import torch

    gpu = None
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        found = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        if found:
            gpu = dict(zip(("name", "driver", "memory_total"), (p.strip() for p in found.splitlines()[0].split(","))))
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    versions["cuda"] = torch.version.cuda
    for name in ("deepspeed", "open_clip_torch", "transformers", "timm", "webdataset", "av", "decord"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"date": date, "gpu": gpu, "cpu_count": os.cpu_count(), "versions": versions}


# ----------------------------------------------------------------------------- stages in their own processes


def run_worker(name: str, context_file: Path) -> int:
    """Stage `name` in this process; its record written as it starts, after each run and as it ends."""
    import stages

    context = json.loads(context_file.read_text())
    folders = [Path(f) for f in context["outputs"]]
    base = {k: context[k] for k in ("dry_run", "environment")} | {"cap_s": context["cap"], "started": utc_now()}
    started = time.monotonic()

    def progress(partial: dict[str, Any]) -> None:
        record_stage(folders, name, {**base, "status": "running", "error": None, "results": partial})

    ctx = stages.Context(stages.DRY if context["dry_run"] else stages.GPU, Path(context["work"]), 0.0, progress)
    ctx.deadline = started + context["cap"] - 5.0  # the runs end before the process is killed
    progress({})
    outcome: dict[str, Any] = {**base, "status": "ok", "error": None}
    try:
        if context["dry_run"] and os.environ.get(STALL_VARIABLE) == name:
            while True:
                time.sleep(0.5)
        outcome["results"] = found = stages.STAGES[name](ctx)
        if found.get("errors"):
            outcome.update(status="failed", error="; ".join(found["errors"])[:2000])
    except Exception as exc:  # recorded; the next stage still runs
        traceback.print_exc()
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:1000]
        outcome.update(status="failed", error=message, results=ctx.partial or None)
    outcome.update(seconds=time.monotonic() - started, finished=utc_now())
    record_stage(folders, name, outcome)
    return 0


def run_stage(name: str, cap: float, work: Path, context: dict[str, Any]) -> dict[str, Any]:
    """`name` in a worker process killed at `cap`; a stage it left without a final record gets one here."""
    from stages import kill_tree

    context_file = work / f"context-{name}.json"
    context_file.write_text(json.dumps({**context, "cap": cap}, default=str))
    log = work / "logs" / f"stage-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(HERE / "suite.py"), "--worker", name, "--context", str(context_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if context["dry_run"]:  # tiny shapes: torch's thread pool only spins against the other processes
        env.setdefault("OMP_NUM_THREADS", "1")
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = process.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            kill_tree(process)  # its training runs too: they must not hold the GPU for the next stage
            code = None
    folders = [Path(f) for f in context["outputs"]]
    found = read_stages(folders[0]).get(name) or {"results": None}
    if found.get("status") not in FINAL or found.get("started", "") < context["started"]:
        text = log.read_text(errors="replace").splitlines()
        tail = " / ".join(line.strip() for line in text[-8:] if line.strip())[-1200:]
        found.update(
            dry_run=context["dry_run"],
            environment=context["environment"],
            cap_s=cap,
            status="timed_out" if code is None else "failed",
            error=f"stopped at its cap ({cap:.0f} s); what it measured before is kept"
            if code is None
            else f"its process exited with {code}: {tail}",
            finished=utc_now(),
        )
        record_stage(folders, name, found)
    for folder in folders:
        archive_logs(work, folder)
    return found


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def merge(paths: list[Path], into: Path) -> dict:
    """One folder of stage files (a later folder's stage replaces an earlier one's) and its report, from the folders
    the commands brought back, with each folder's logs as logs-N.tar.gz."""
    stages: dict[str, dict] = {}
    for path in paths:
        stages.update(read_stages(path))
    machines = {((s.get("environment") or {}).get("gpu") or {}).get("name") for s in stages.values()}
    if len(machines) > 1:
        raise SystemExit(f"the stages come from different machines ({machines}): not merged")
    for name, stage in stages.items():
        write_atomic(into / f"stage-{name}.json", json.dumps(stage, indent=1, default=str) + "\n")
    for index, path in enumerate(paths, 1):
        if (path / "logs.tar.gz").is_file():
            write_atomic(into / f"logs-{index}.tar.gz", (path / "logs.tar.gz").read_bytes())
    return rebuild(into)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print the commands to run on the GPU machine")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 steps per run")
    parser.add_argument("--group", choices=sorted(COMMANDS), help="the stages of one command of the plan")
    parser.add_argument("--only", default=None, help="comma-separated stages (default: all)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all stages together")
    parser.add_argument("--cap", type=float, default=None, help="seconds for every stage (default: CAPS)")
    parser.add_argument("--output-dir", type=Path, default=None, help="where the stage files and gpu.md go")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (corpora, runs, logs)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="folders to merge")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan:
        print(describe())
        return 0
    if args.worker:
        return run_worker(args.worker, args.context)
    if args.merge:
        record = merge(args.merge, args.output_dir or RESULTS)
        return 0 if all(s["status"] == "ok" for s in record["stages"].values()) else 1
    names = list(COMMANDS[args.group]) if args.group else (args.only or ",".join(CAPS)).split(",")
    if set(names) - set(CAPS):
        parser.error(f"unknown stage(s) {', '.join(sorted(set(names) - set(CAPS)))}; choose from {', '.join(CAPS)}")

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: the suite measures GPUs (use --dry-run to check it on CPU)", file=sys.stderr)
        return 2
    started = time.monotonic()
    end = started + (args.budget if args.budget is not None else float("inf"))
    if args.group:
        command_start = os.environ.get(COMMAND_START_VARIABLE)
        spent = time.time() - float(command_start) if command_start else SETUP_S
        end = min(end, started + COMMAND_S - spent - END_MARGIN_S)
    work = args.work or Path(tempfile.gettempdir()) / ("mmpt-gpu-dry" if args.dry_run else "mmpt-gpu-bench")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    first = args.output_dir or (Path(tempfile.mkdtemp(prefix="mmpt-gpu-dry-")) if args.dry_run else out or RESULTS)
    folders = [first, *([out] if out is not None and out.resolve() != first.resolve() else [])]
    for folder in [work, *folders]:
        folder.mkdir(parents=True, exist_ok=True)
    context = {
        "dry_run": args.dry_run,
        "work": str(work),
        "outputs": [str(f) for f in folders],
        "environment": environment(),
        "started": utc_now(),
    }
    print(f"suite: {', '.join(names)}; results in {', '.join(map(str, folders))}", flush=True)
    outcomes = {}
    for name in names:
        cap = args.cap or (DRY_CAP_S if args.dry_run else CAPS[name])
        left = end - time.monotonic()
        if min(cap, left) < min(MIN_STAGE_S, cap):
            outcomes[name] = {**context, "status": "skipped", "error": f"not started: {max(0, left):.0f} s left"}
            record_stage(folders, name, {k: v for k, v in outcomes[name].items() if k not in ("work", "outputs")})
        else:
            outcomes[name] = run_stage(name, min(cap, left), work, context)
        print(f"stage {name}: {outcomes[name]['status']} {outcomes[name].get('error') or ''}", flush=True)
    failed = [n for n, s in outcomes.items() if s["status"] != "ok"]
    print(f"suite: {len(names) - len(failed)} of {len(names)} stages ok" + (f"; not ok: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

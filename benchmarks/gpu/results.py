"""The suite's results on disk: one file per stage, written the moment the stage ends, and the report rebuilt
from whatever stage files a folder holds.

    <folder>/stage-<name>.json   a stage's record: status (running, ok, failed, timed_out, skipped), error,
                                 results, seconds, cap, the machine it ran on
    <folder>/gpu.json, gpu.md    every stage file of the folder together, and the report of them

Every file is written to a temporary name and renamed into place, so a command killed at any moment leaves
each file whole: the finished stages' records, and the running one's `running` record.
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from pathlib import Path
from typing import Any

PREFIX = "stage-"
FINAL = ("ok", "failed", "timed_out", "skipped")


def write_atomic(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def stage_file(folder: Path, name: str) -> Path:
    return folder / f"{PREFIX}{name}.json"


def read_stages(folder: Path) -> dict[str, dict[str, Any]]:
    """{stage: record} of every readable stage file in `folder`."""
    found = {}
    for path in sorted(folder.glob(f"{PREFIX}*.json")):
        try:
            found[path.stem[len(PREFIX) :]] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not ours, or not whole: the report says nothing of it
    return found


def collect(folder: Path, order: list[str]) -> dict[str, Any]:
    """The suite's record (gpu.json) from the stage files of `folder`, stages in `order` first."""
    stages = read_stages(folder)
    ordered = {name: stages[name] for name in order if name in stages}
    ordered.update({name: record for name, record in stages.items() if name not in ordered})
    environments = [s["environment"] for s in ordered.values() if s.get("environment")]
    record: dict[str, Any] = {
        "suite": "benchmarks/gpu/suite.py",
        "dry_run": any(s.get("dry_run") for s in ordered.values()),
        "environment": environments[0] if environments else {},
        "stages": ordered,
    }
    machines = {gpu_name(e) for e in environments}
    if len(machines) > 1:
        record["machines"] = {name: gpu_name(s.get("environment") or {}) for name, s in ordered.items()}
    return record


def gpu_name(environment: dict[str, Any]) -> str:
    gpu = environment.get("gpu") or {}
    return gpu.get("name") or f"no GPU ({environment.get('cpu_count')} CPU cores)"


def rebuild(folder: Path, order: list[str]) -> dict[str, Any]:
    """gpu.json and gpu.md of `folder` from its stage files, as they are now."""
    from report import markdown

    record = collect(folder, order)
    write_atomic(folder / "gpu.json", json.dumps(record, indent=1, default=str) + "\n")
    write_atomic(folder / "gpu.md", markdown(record))
    return record


def record_stage(folders: list[Path], name: str, outcome: dict[str, Any], order: list[str]) -> None:
    """`name`'s record into every folder, each folder's report rebuilt at once."""
    text = json.dumps(outcome, indent=1, default=str) + "\n"
    for folder in folders:
        write_atomic(stage_file(folder, name), text)
        rebuild(folder, order)


def archive_logs(work: Path, folder: Path, parts: tuple[str, ...] = ("logs", "configs")) -> None:
    """logs.tar.gz of the work folder's logs and run configs, replaced whole."""
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".logs.tar.gz.")
    os.close(handle)
    try:
        with tarfile.open(temporary, "w:gz") as archive:
            for part in parts:
                if (work / part).exists():
                    archive.add(work / part, arcname=part)
        os.replace(temporary, folder / "logs.tar.gz")
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

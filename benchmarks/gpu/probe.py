"""Run a training entry point in this process and record what its own logs lack.

    python benchmarks/gpu/probe.py RESULT.json [--mmpt] -- SCRIPT [ARGS...]

SCRIPT runs as `__main__` (launch/train.py, benchmarks/open_clip_main.py: the entry points as users
start them). RESULT.json gets: status (ok, oom, error), the error line, the peak device memory
(torch.cuda.max_memory_allocated / max_memory_reserved; null on CPU) and the wall time.

`--mmpt` benchmarks an mmpt run: the steps are what is measured, so the run's final checkpoint
(several GB of optimizer state for a 0.4B model) and the consolidation of its weights are skipped
by replacing `mmpt.engine.checkpoint.Checkpointer.save` and `mmpt.engine.trainer.finish`; the peak is read where
`finish` would start, right after the last step.

Where CUDA is, every run goes with `torch.cuda.set_sync_debug_mode("warn")` on: each operation that makes the
host wait for the device warns, and RESULT.json counts the warnings: in all, by the point of the step the
run had last reached (mmpt's step hooks; `setup` before the first), and by the Python line that called.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning in sync debug mode "warn"
SHOWN_SYNC_WARNINGS = 3  # printed to the log; the rest only counted


class SyncWarnings:
    """Sync debug mode "warn" on (where CUDA is) while inside, and its warnings counted, not printed beyond the
    first few. `reached(point, step)` is a step-hook observer: warnings are counted by the last point reached."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        self.point = "setup"
        self.by_point: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    def __enter__(self) -> SyncWarnings:
        import torch

        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        self._show = warnings.showwarning
        warnings.showwarning = self._seen
        self.active = torch.cuda.is_available()
        if self.active:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.active:
            torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(*exc)

    def reached(self, point: str, step: int) -> None:
        self.point = point

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        site = f"{short_path(filename)}:{lineno}"
        self.count += 1
        self.by_point[self.point] += 1
        self.sites[site] += 1
        if self.count <= SHOWN_SYNC_WARNINGS:
            print(f"sync warning {self.count} (after {self.point}): {site}", file=sys.stderr, flush=True)

    def record(self) -> dict[str, Any]:
        return {
            "sync_debug": "warn" if self.active else "off: no CUDA device",
            "sync_warnings": self.count,
            "sync_warnings_in_steps": self.count - self.by_point["setup"],
            "sync_warnings_by_point": dict(self.by_point),
            "sync_warning_sites": dict(self.sites.most_common(8)),
        }


def short_path(filename: str) -> str:
    """A file name from site-packages or the repository, without the machine's folders before it."""
    for marker in ("site-packages/", str(Path(__file__).resolve().parents[2]) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def device_memory() -> dict[str, float | None]:
    """Peak allocated and reserved device memory of this process in MiB (None without CUDA)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"peak_allocated_mib": None, "peak_reserved_mib": None}
    return {
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
        "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
    }


def reset_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@contextmanager
def steps_only(record: dict[str, Any]) -> Iterator[None]:
    """mmpt without its final checkpoint and weight consolidation; the peak is recorded after the last step."""
    from mmpt.engine import trainer
    from mmpt.engine.checkpoint import Checkpointer

    for owner, name in ((Checkpointer, "save"), (trainer, "finish")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(f"{owner.__name__}.{name} is gone: update benchmarks/gpu/probe.py to the engine")
    saved = Checkpointer.save, trainer.finish

    def finish(*args: Any, **kwargs: Any) -> dict:
        record.update(device_memory())
        return {}

    Checkpointer.save, trainer.finish = (lambda *args, **kwargs: None), finish  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield
    finally:
        Checkpointer.save, trainer.finish = saved


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or any(m in str(exc) for m in OOM_MARKERS)


def run_entry(script: str, args: list[str], mmpt: bool = False) -> dict[str, Any]:
    """Run `script` as __main__ with `args`; never raises (the outcome is in the returned record)."""
    record: dict[str, Any] = {"status": "ok", "error": None}
    if mmpt:
        os.environ["MMPT_DEBUG"] = "1"  # launch/train.py re-raises instead of turning errors into exit lines
    reset_device_memory()
    started = time.perf_counter()
    argv = sys.argv
    sys.argv = [script, *args]
    syncs = SyncWarnings()
    try:
        with syncs, steps_only(record) if mmpt else _nothing(), observed(syncs.reached, mmpt):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            record.update(status="error", error=f"{Path(script).name} exited with {exc.code}")
    except Exception as exc:  # reported in the record: the caller decides what a failure means
        traceback.print_exc()
        status = "oom" if is_oom(exc) else "error"
        record.update(status=status, error=" ".join(f"{type(exc).__name__}: {exc}".split())[:600])
    finally:
        sys.argv = argv
    record["wall_s"] = time.perf_counter() - started
    record.update(syncs.record())
    if record.get("peak_allocated_mib") is None:
        record.update(device_memory())
    return record


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def observed(observer: Any, mmpt: bool) -> Any:
    """mmpt's step hooks tell `observer` each point a run reaches; other trainers have none."""
    if not mmpt:
        return _nothing()
    from mmpt.engine.hooks import observing

    return observing(observer)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, (script, *args) = argv[:split], argv[split + 1 :]
    result = Path(options[0])
    record = run_entry(script, args, mmpt="--mmpt" in options)
    result.write_text(json.dumps(record, indent=1))
    return {"ok": 0, "oom": 3}.get(record["status"], 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

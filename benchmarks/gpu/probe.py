"""Run a training entry point in this process and record what its own logs lack.

    python benchmarks/gpu/probe.py RESULT.json [--mmpt] [--profile FIRST,COUNT] -- SCRIPT [ARGS...]

SCRIPT runs as `__main__` (launch/train.py, benchmarks/open_clip_main.py: the entry points as users
start them). RESULT.json gets: status (ok, oom, error), the error line, the peak device memory
(torch.cuda.max_memory_allocated / max_memory_reserved; null on CPU) and the wall time; for mmpt, the peak
of each phase of the steps as well (`PeakByPhase`). `--profile FIRST,COUNT`: mmpt's steps FIRST.. under
torch.profiler, summarised in RESULT.json (`StepProfiler`), the trace beside it (RESULT.trace.json.gz).

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
TRACE_LIMIT_BYTES = 6 * 2**20  # a gzipped profiler trace kept in the logs archive (a call brings back 16 MiB a file)


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


class PeakByPhase:
    """The peak allocated device memory of each phase of the steps (from one step point to the next: data,
    forward, backward, step, log; `setup` before the first), the highest over the run: where a run's peak is,
    which the planner's parts (states, activations, logits) can be held against. The allocator's statistics
    live on the host: reading and resetting them waits for nothing on the device. The resets reach the run's
    own metrics too: under the probe its logged GPU peaks are those since the last step point."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.allocated = self.reserved = 0  # over the whole run, across the resets

    def reached(self, point: str, step: int) -> None:
        self._close()
        self.phase = point

    def _close(self) -> None:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        self.allocated, self.reserved = max(self.allocated, allocated), max(self.reserved, reserved)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), allocated)
        torch.cuda.reset_peak_memory_stats()

    def record(self, memory: dict[str, float | None]) -> dict[str, Any]:
        """`memory` (device_memory() read at the end) with the peaks before the last reset folded in."""
        self._close()
        if not self.peaks:
            return {**memory, "peak_allocated_mib_by_phase": None}
        mib = 2**20
        return {
            "peak_allocated_mib": max(memory["peak_allocated_mib"] or 0.0, self.allocated / mib),
            "peak_reserved_mib": max(memory["peak_reserved_mib"] or 0.0, self.reserved / mib),
            "peak_allocated_mib_by_phase": {name: peak / mib for name, peak in self.peaks.items()},
        }


class StepProfiler:
    """torch.profiler over steps `first` to `first + count - 1` of an mmpt run (started and stopped at the step
    hooks' `data` point), summarised into the record: the device time of each step against its wall time (the
    share the GPU idled), kernels and host-device copies per step, and the operators with the most device
    time. The trace itself goes to `trace` (gzipped Chrome trace) when given."""

    def __init__(self, first: int, count: int, trace: Path | None = None) -> None:
        self.first, self.count, self.trace = first, count, trace
        self.profiler: Any = None
        self.summary: dict[str, Any] | None = None
        self._started = 0.0

    def reached(self, point: str, step: int) -> None:
        if point != "data" or self.summary is not None:
            return
        if step == self.first and self.profiler is None:
            self._start()
        elif step == self.first + self.count and self.profiler is not None:
            self._stop()

    def close(self) -> None:
        """Stop a profiler the run left running: it ended (failed) inside the profiled steps."""
        if self.profiler is not None and self.summary is None:
            self.profiler.stop()
            self.summary = {"error": "the run ended inside the profiled steps"}

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        synchronize()
        self.profiler = profile(activities=activities)
        self.profiler.start()
        self._started = time.perf_counter()

    def _stop(self) -> None:
        synchronize()
        wall = time.perf_counter() - self._started
        self.profiler.stop()
        self.summary = summarise_profile(self.profiler, wall, self.count)
        if self.trace is not None:
            import gzip

            raw = self.trace.with_suffix("")
            self.profiler.export_chrome_trace(str(raw))
            with raw.open("rb") as source, gzip.open(self.trace, "wb") as target:
                target.write(source.read())
            raw.unlink()
            size = self.trace.stat().st_size
            if size > TRACE_LIMIT_BYTES:  # the logs archive must come back whole
                self.trace.unlink()
            self.summary["trace"] = self.trace.name if size <= TRACE_LIMIT_BYTES else f"dropped: {size / 2**20:.1f} MiB"


def synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) spans: kernels on several streams overlap."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def summarise_profile(profiler: Any, wall_s: float, steps: int, top: int = 15) -> dict[str, Any]:
    """Per step: device busy time (the time some kernel ran, on any stream), kernels, memcpy and memset counts;
    the operators with the most self device time (self CPU time on a CPU run)."""
    events = profiler.events()
    device = [e for e in events if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"]
    kernels = [e for e in device if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) if device else None
    key = "self_device_time_total" if device else "self_cpu_time_total"
    averages = sorted(profiler.key_averages(), key=lambda a: getattr(a, key), reverse=True)
    return {
        "steps": steps,
        "wall_s_per_step": wall_s / steps,
        "device_busy_s_per_step": None if busy is None else busy / 1e6 / steps,
        "device_idle_share": None if busy is None else max(0.0, 1 - busy / 1e6 / wall_s),
        "kernels_per_step": len(kernels) / steps if device else None,
        "memcpy_per_step": {
            kind: sum(1 for e in device if kind.lower() in e.name.lower()) / steps for kind in ("HtoD", "DtoH", "DtoD")
        }
        if device
        else None,
        "top_ops": [
            {
                "name": a.key[:120],
                "calls_per_step": a.count / steps,
                "ms_per_step": getattr(a, key) / 1e3 / steps,
                "measure": "self device time" if device else "self CPU time",
            }
            for a in averages[:top]
        ],
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


def run_entry(script: str, args: list[str], mmpt: bool = False, profile: StepProfiler | None = None) -> dict[str, Any]:
    """Run `script` as __main__ with `args`; never raises (the outcome is in the returned record). `profile`:
    mmpt's steps it names are profiled (the summary in the record's `profile`)."""
    record: dict[str, Any] = {"status": "ok", "error": None}
    if mmpt:
        os.environ["MMPT_DEBUG"] = "1"  # launch/train.py re-raises instead of turning errors into exit lines
    reset_device_memory()
    started = time.perf_counter()
    argv = sys.argv
    sys.argv = [script, *args]
    syncs, phases = SyncWarnings(), PeakByPhase()
    try:
        with (
            syncs,
            steps_only(record) if mmpt else _nothing(),
            observed(syncs.reached, mmpt),
            observed(phases.reached, mmpt),
            observed(profile.reached, mmpt) if profile is not None else _nothing(),
        ):
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
        if profile is not None:
            profile.close()
    record["wall_s"] = time.perf_counter() - started
    record.update(syncs.record())
    if record.get("peak_allocated_mib") is None:
        record.update(device_memory())
    if mmpt:
        record.update(phases.record({k: record.get(k) for k in ("peak_allocated_mib", "peak_reserved_mib")}))
    if profile is not None:
        record["profile"] = profile.summary
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
    profile = None
    if "--profile" in options:  # --profile FIRST,COUNT: those steps under torch.profiler, the trace beside RESULT
        first, count = (int(v) for v in options[options.index("--profile") + 1].split(","))
        profile = StepProfiler(first, count, result.with_suffix(".trace.json.gz"))
    record = run_entry(script, args, mmpt="--mmpt" in options, profile=profile)
    result.write_text(json.dumps(record, indent=1))
    return {"ok": 0, "oom": 3}.get(record["status"], 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

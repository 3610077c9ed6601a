"""Training metrics: per-step loss terms averaged over ranks, throughput, per-rank step time.

Rank 0 writes `metrics.jsonl` (one line per logged step), TensorBoard scalars, W&B and a progress bar.
`log_window` is a collective: every rank calls it at the same steps. Loss terms are summed on the device
and read only there, so steps between logging steps never wait for the host.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from mmpt import distributed as mdist
from mmpt.config import WandbConfig
from mmpt.data import counts as data_counts
from mmpt.data.counts import describe
from mmpt.engine.timing import Clock

WANDB_ID_FILE = "wandb_run_id"  # a resumed run continues the W&B run it started


def start_wandb(settings: WandbConfig, run_dir: Path, config: dict):
    """The W&B run of `run_dir` (resumed when the folder already has one), with the resolved config."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:8] + "\n")  # W&B's own id shape: 8 lowercase letters and digits
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=settings.name or run_dir.name,
        mode=settings.mode,
        tags=settings.tags or None,
        dir=str(run_dir),
        config=config,
        id=id_file.read_text().strip(),
        resume="allow",
    )


log = logging.getLogger(__name__)


def device_memory_gib() -> tuple[float, float]:
    """(peak allocated, peak reserved) GiB of this rank's GPU since the run started, read from the caching
    allocator's counters on the host: nothing waits for the device."""
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def scalars_of(record: dict) -> dict:
    """A record's scalars for TensorBoard and W&B: its numbers but the step, per-rank lists as `<key>/rank<n>`."""
    scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
    for key, value in record.items():
        if isinstance(value, list):
            scalars.update({f"{key}/rank{rank}": item for rank, item in enumerate(value)})
    return scalars


class MetricLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_steps: int,
        start_step: int,
        global_batch: int,
        tensorboard: bool,
        progress_bar: bool,
        wandb: WandbConfig | None = None,
        config: dict | None = None,
        gpu: bool = False,
        data_group: dist.ProcessGroup | None = None,
        peak_tflops: float | None = None,
    ):
        """`gpu`: the run trains on GPUs (every rank alike): each window then gathers each rank's peak memory.
        `data_group`: the ranks that read different samples (None: all), over which sample counts are summed.
        `peak_tflops`: the dense TFLOP/s per GPU `perf/mfu` is stated against; with it and `flops_per_sample` (set
        by the engine once counted, `mmpt.engine.flops`) each window logs perf/tflops and perf/mfu."""
        self.rank = mdist.get_rank()
        self.run_dir = run_dir
        self.health_summary: dict[str, dict[str, float]] = {"stragglers": {}}  # the ranks the health monitor named
        self.global_batch = global_batch
        self.gpu = gpu
        self.data_group = data_group
        self.peak_tflops = peak_tflops
        self.flops_per_sample: float | None = None  # a training step's FLOPs per sample, recompute included
        self.data_counts: dict[str, dict[str, int]] = {}  # the latest reduced sample counts, for the summary
        self.parameters: dict[str, int] = {}  # the model's (`mmpt.engine.summary.parameter_counts`), for the summary
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self.clock = Clock(cuda=False)  # the window's wall time, read after its work has finished
        self._window_start = self.clock.mark()
        self._excluded = 0.0  # seconds of the window spent on other things (`exclude`)
        self._jsonl = self._writer = self._bar = self._wandb = None
        if self.rank == 0:
            if wandb is not None:
                self._wandb = start_wandb(wandb, run_dir, config or {})
            # Open for the whole run, line by line; `close` closes it.
            self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(run_dir / "tensorboard"))
            if progress_bar:
                self._bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True, mininterval=1.0)

    def update(self, losses: dict[str, torch.Tensor]) -> None:
        """Add one step's loss terms (device tensors; nothing is read back here)."""
        for name, value in losses.items():
            value = value.detach().double()
            self._sums[name] = self._sums[name] + value if name in self._sums else value
        self._count += 1
        if self._bar is not None:
            self._bar.update(1)

    def log_window(
        self,
        step: int,
        lr: float,
        times: dict[str, float],
        counts: dict[str, dict[str, int]],
        sources: list[str],
        skipped_steps: int,
        state_bytes: tuple[float, float | None] | None,
        per_rank: dict | None = None,
    ) -> dict:
        """Reduce the window over ranks and write it (rank 0); returns the record. Every rank calls it.

        `counts`: this rank's sample counts by source (`sources` in order); `state_bytes`: this rank's
        (optimizer state, momentum copies) bytes, the second None when the model keeps no momentum copies;
        `per_rank`: fields already gathered over ranks (the health monitor's collective timings).
        """
        local = data_counts.flatten(counts, sources)
        summed = mdist.all_reduce_sum(torch.tensor(local, dtype=torch.float64), self.data_group).tolist()
        self.data_counts = data_counts.nest(summed, sources)
        optimizer_bytes, momentum_bytes = state_bytes or (0.0, None)
        mib = mdist.all_gather_floats([optimizer_bytes / 2**20, (momentum_bytes or 0.0) / 2**20])
        extra: dict = {
            **data_counts.metrics(self.data_counts),
            "skipped_steps": skipped_steps,
            "optimizer_state_mib_per_rank": [round(m[0], 1) for m in mib],
        }
        if momentum_bytes is not None:
            extra["momentum_copy_mib_per_rank"] = [round(m[1], 3) for m in mib]
        extra.update(per_rank or {})
        record = self.reduce(step, lr, times, extra)
        self.write(step, record)
        return record

    def reduce(self, step: int, lr: float, times: dict[str, float], extra: dict[str, float] | None = None) -> dict:
        """The window reduced over ranks, as a record (on every rank); `write` emits it.

        `times`: this rank's seconds in the window's "data" and "forward" spans ("gather" waits taken out),
        read after the window's work has finished, so the window's wall time is the work's time too.
        """
        names = sorted(self._sums)
        count = max(1, self._count)
        local = torch.stack([self._sums[n] for n in names]) / count if names else torch.zeros(0, dtype=torch.float64)
        means = mdist.all_reduce_mean(local).tolist()
        elapsed = self.clock.seconds(self._window_start, self.clock.mark()) - self._excluded
        forward = times.get("forward", 0.0) - times.get("gather", 0.0)
        memory = device_memory_gib() if self.gpu else None
        per_rank = mdist.all_gather_floats(
            [elapsed / count, times.get("data", 0.0) / count, forward / count, *(memory or ())]
        )
        # loss terms as loss/<name>; a method's diagnostics ("train/i2t_acc") under their own names
        named = {n if n.startswith("train/") else f"loss/{n}": v for n, v in zip(names, means)}
        record: dict = {"step": step, "lr": lr, **named}
        record["samples_per_s"] = self._count * self.global_batch / max(elapsed, 1e-9)
        if self.flops_per_sample is not None and self.peak_tflops is not None:
            # Achieved TFLOP/s per GPU: the window's FLOPs over all ranks, over its wall time and the ranks.
            tflops = self.flops_per_sample * record["samples_per_s"] / mdist.get_world_size() / 1e12
            record["perf/tflops"] = tflops
            record["perf/mfu"] = tflops / self.peak_tflops
        record["step_time_per_rank"] = [round(r[0], 5) for r in per_rank]
        record["data_time_per_rank"] = [round(r[1], 5) for r in per_rank]
        record["forward_time_per_rank"] = [round(r[2], 5) for r in per_rank]
        if memory is not None:
            record["gpu_peak_allocated_gib_per_rank"] = [round(r[3], 2) for r in per_rank]
            record["gpu_peak_reserved_gib_per_rank"] = [round(r[4], 2) for r in per_rank]
        record.update(extra or {})
        self._sums.clear()
        self._count = 0
        self._window_start, self._excluded = self.clock.mark(), 0.0
        return record

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` just spent on something else than training out of the current window's time."""
        self._excluded += seconds

    def write(self, step: int, record: dict) -> None:
        """Rank 0: write the record (jsonl, TensorBoard, console)."""
        if self.rank != 0:
            return
        self._emit(step, record)

    def _jsonl_file(self):
        """Rank 0's metrics.jsonl (line-buffered: each record is written out whole as it comes)."""
        assert self._jsonl is not None, "only rank 0 writes metrics"
        return self._jsonl

    def _publish(self, step: int, record: dict) -> None:
        """One line of metrics.jsonl; its scalars, per-rank lists as `<key>/rank<n>`, to TensorBoard and W&B."""
        self._jsonl_file().write(json.dumps({"step": step, **record}) + "\n")
        scalars = scalars_of(record)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def _say(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def _emit(self, step: int, record: dict) -> None:
        self._publish(step, record)
        losses = " ".join(f"{k.removeprefix('loss/')}={v:.4f}" for k, v in record.items() if k.startswith("loss/"))
        diagnostics = " ".join(
            f"{k.removeprefix('train/')}={v:.3g}" for k, v in record.items() if k.startswith("train/")
        )
        if diagnostics:
            losses += f" {diagnostics}"
        message = f"step {step} {losses} lr={record['lr']:.2e} samples/s={record['samples_per_s']:.1f}"
        if "perf/mfu" in record:
            message += f" tflops={record['perf/tflops']:.1f} mfu={100 * record['perf/mfu']:.1f}%"
        if "gpu_peak_allocated_gib_per_rank" in record:  # the fullest rank's
            message += f" gpu_peak={max(record['gpu_peak_allocated_gib_per_rank']):.1f}GiB"
        if self._bar is not None:
            self._bar.set_postfix_str(losses, refresh=False)
        self._say(message)

    def write_eval(self, step: int, results: dict[str, float]) -> None:
        """Rank 0: one evaluation's results (jsonl, TensorBoard, console)."""
        if self.rank != 0 or not results:
            return
        self._publish(step, results)
        shown = " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in results.items() if not k.endswith("/seconds"))
        seconds = sum(v for k, v in results.items() if k.endswith("/seconds"))
        self._say(f"eval step {step} {shown} ({seconds:.1f} s)")

    def write_final(self, step: int, results: dict) -> None:
        """Rank 0: the evaluation at the end of training, a line in metrics.jsonl (and the W&B run's summary)."""
        if self.rank != 0:
            return
        self._jsonl_file().write(json.dumps({"step": step, **results}) + "\n")
        if self._wandb is not None:
            self._wandb.log(scalars_of(results), step=step)
            self._wandb.summary.update({k: v for k, v in results.items() if isinstance(v, (int, float))})

    def end_progress(self) -> None:
        """Close the progress bar when the steps are done: what is printed next starts a line of its own, also in
        a log that holds both stdout and stderr."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        if self.rank == 0:
            summary = {**self.health_summary, "parameters": self.parameters, "data": self.data_counts}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        for handle in (self._bar, self._writer, self._jsonl):
            if handle is not None:
                handle.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        for group, counts in self.data_counts.items():  # after the progress bar, on lines of their own
            if self.rank == 0:
                print(f"data ({'all sources' if group == 'all' else group}): {describe(counts)}", flush=True)

"""The non-finite guard: a step with a NaN/Inf loss or gradient is skipped on every rank (`SkippingAdamW`
at ZeRO 0-2, on the device; DeepSpeed's overflow check at ZeRO-3, with fp16 or an offloaded optimizer:
the bad values reach every rank through the gradient reduction); this counts the skips and stops the run
after too many in a row.

The counts stay on the device and are read at logging steps only, so the run stops at the first
logging step after the limit is reached (at most `train.log_every` - 1 more skipped steps). At ZeRO 0-2
the skip happens inside the optimizer kernel, so hooks that run after the optimizer (a momentum copy's
EMA update) still run on a skipped step and move the copy towards the unchanged weights.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many optimizer steps in a row were non-finite."""


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int, device: torch.device):
        self.max_in_a_row = max_in_a_row
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.in_a_row, self.worst_in_a_row, self.in_window, self.total = zero, zero, zero, zero
        self._window_skips = self._worst = 0

    def update(self, skipped: torch.Tensor | bool) -> None:
        """After every optimizer step; `skipped` may be a device tensor (1.0 or 0.0), which is not read here."""
        self.in_a_row = (self.in_a_row + 1) * skipped
        self.worst_in_a_row = torch.maximum(self.worst_in_a_row, self.in_a_row)
        self.in_window = self.in_window + skipped
        self.total = self.total + skipped

    def read(self) -> int:
        """At a logging step (a host read): the steps skipped since the start of the run."""
        self._window_skips, self._worst, total = (
            int(v) for v in torch.stack([self.in_window, self.worst_in_a_row, self.total]).tolist()
        )
        self.in_window = self.in_window * 0
        self.worst_in_a_row = self.in_a_row
        return total

    def check(self, step: int, losses: dict[str, float]) -> None:
        """After `read()`: warn about the window's skipped steps; raise once `max_in_a_row` were skipped in a row."""
        if self._window_skips:
            log.warning(
                "%d step(s) skipped up to step %d: non-finite loss or gradients (%d in a row at most; losses %s)",
                self._window_skips,
                step,
                self._worst,
                {k: round(v, 4) for k, v in losses.items()},
            )
        if self._worst >= self.max_in_a_row:
            raise NonFiniteError(
                f"stopping at step {step}: {self._worst} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.max_in_a_row}); last losses {losses}. Lower optim.lr, check the data "
                "(data/skipped in metrics.jsonl) or use fp32, then resume from the last checkpoint."
            )

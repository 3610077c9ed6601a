"""The non-finite guard: a step with a NaN/Inf loss or gradient is skipped on every rank (DeepSpeed's
overflow check at ZeRO 1-3, `SkippingAdamW` at ZeRO 0: the bad values reach every rank through the
gradient reduction); this counts the skips and stops the run after too many in a row."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many optimizer steps in a row were non-finite."""


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def check(self, step: int, applied: bool, losses: dict[str, float]) -> None:
        """Call after every optimizer step; raises once `max_in_a_row` steps in a row were skipped."""
        self.in_a_row = 0 if applied else self.in_a_row + 1
        if not self.in_a_row:
            return
        log.warning("step %d skipped: non-finite loss or gradients (%d in a row; losses %s)", step, self.in_a_row,
                    {k: round(v, 4) for k, v in losses.items()})
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"stopping at step {step}: {self.in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.max_in_a_row}); last losses {losses}. Lower optim.lr, check the data "
                "(data/skipped in metrics.jsonl) or use fp32, then resume from the last checkpoint.")

"""Per-rank micro-batches that follow each rank's speed (`train.adaptive_batch`), so a slow rank stops holding
every step back (AntDT's straggler mitigation, our design of it).

The loader hands out units of `data.train.batch_size / train.adaptive_batch_units` samples; rank r reads
`units[r]` of them per micro-batch. The units always add up to the equal shares' total, so the global batch
never changes. At each logging window every rank holds every rank's busy time (the health monitor's gather),
so every rank computes the same new shares, every `WINDOWS_PER_DECISION` windows, from the medians of the
busy times (one disturbed window does not move the shares). A rank's busy time is modelled as a fixed part
(its optimizer step, which a slow rank also runs slowly) plus a part per unit, fitted to the windows it ran
at different shares (proportional to its units until it has run at two); the new shares are the ones that
make the slowest rank's predicted time smallest, adopted only when that is at least `MIN_GAIN` shorter than
now (measurements are noisy; shares that flap cost recompilations and steady memory).

The losses then hold uneven rows (the run's `mmpt.distributed.Collectives`), and each rank's loss is weighed by
its share (`loss_weight`), so that the engine's gradient mean over ranks is the gradient of the whole global
batch, as with equal shares.
"""

from __future__ import annotations

import heapq
import logging
import statistics
from collections.abc import Sequence
from typing import Any

from mmpt.config import Config, ConfigError

log = logging.getLogger(__name__)

MIN_GAIN = 0.05  # new shares must shorten the predicted step by this fraction
WINDOWS_PER_DECISION = 3  # windows at the current shares before the next decision: their median is what counts


def check_adaptive_batch(cfg: Config) -> None:
    """Refuse the settings adaptive batches cannot work with (before anything is built)."""
    train, batch = cfg.train, cfg.data.train.batch_size
    if not train.adaptive_batch:
        return
    if train.sequence_parallel > 1:
        raise ConfigError(
            f"config key 'train.adaptive_batch': not supported with train.sequence_parallel={train.sequence_parallel} "
            "(the ranks splitting one batch's sequences must hold the same samples); set one of them off"
        )
    if batch % train.adaptive_batch_units:
        raise ConfigError(
            f"config key 'train.adaptive_batch_units': {train.adaptive_batch_units} does not divide "
            f"data.train.batch_size={batch}; pick a divisor, so that every unit holds the same number of samples"
        )


def largest_share(cfg: Config) -> int:
    """The largest micro-batch a rank may hold: `data.train.batch_size`, or its adaptive maximum."""
    shares = BatchShares.of(cfg, ranks=1, rank=0)
    return cfg.data.train.batch_size if shares is None else shares.most * shares.unit


class BatchShares:
    """Every data-parallel rank's micro-batch in loader units (the same list on every rank); a checkpoint part."""

    def __init__(self, ranks: int, rank: int, per_rank: int, unit: int, max_share: float):
        self.rank, self.per_rank, self.unit = rank, per_rank, unit
        self.most = max(per_rank, int(max_share * per_rank))
        self.units = [per_rank] * ranks
        self._started = False  # the first window of a process holds its start-up work: not a measure of speed
        self._busy: list[dict[int, list[float]]] = [{} for _ in range(ranks)]  # per rank: units -> busy times
        self._windows = 0  # windows since the last decision

    @classmethod
    def of(cls, cfg: Config, ranks: int, rank: int) -> BatchShares | None:
        """The run's shares when `train.adaptive_batch` is on, else None."""
        train = cfg.train
        if not train.adaptive_batch:
            return None
        units = train.adaptive_batch_units
        return cls(ranks, rank, units, cfg.data.train.batch_size // units, train.adaptive_batch_max_share)

    @property
    def mine(self) -> int:
        """This rank's units per micro-batch."""
        return self.units[self.rank]

    def samples(self) -> list[int]:
        return [units * self.unit for units in self.units]

    def loss_weight(self) -> float:
        """What this rank's loss is multiplied by: ranks x its share of the global batch (1 for equal shares)."""
        return self.mine / self.per_rank

    def update(self, busy_seconds: Sequence[float]) -> bool:
        """New shares from every rank's busy time over a window run at the current shares; whether they changed."""
        if not self._started:
            self._started = True
            return False
        for history, units, seconds in zip(self._busy, self.units, busy_seconds):
            history[units] = (history.get(units, []) + [seconds])[-WINDOWS_PER_DECISION:]
        self._windows += 1
        if self._windows < WINDOWS_PER_DECISION:
            return False
        self._windows = 0
        costs = [cost_model(history, units) for history, units in zip(self._busy, self.units)]
        proposal = fastest_shares(costs, sum(self.units), self.most)
        if step_time(proposal, costs) > (1 - MIN_GAIN) * step_time(self.units, costs):
            return False
        self.units = proposal
        if self.rank == 0:
            log.info("adaptive batches: micro-batch per rank now %s samples", self.samples())
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"units": list(self.units), "per_rank": self.per_rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["per_rank"] == self.per_rank and len(state["units"]) == len(self.units):
            self.units = list(state["units"])  # else the units changed size: start again from equal shares

    def load_resharded(self, states: Sequence[Any], step: int) -> None:
        """Another number of ranks: start again from equal shares."""


Cost = tuple[float, float]  # a rank's (fixed seconds, seconds per unit) in a window


def cost_model(history: dict[int, list[float]], units: int) -> Cost:
    """A rank's cost from its busy times per unit count: a least-squares line once it ran at two counts (if
    that line is increasing and not below zero at zero units), else proportional to the current count."""
    points = [(n, statistics.median(times)) for n, times in history.items()]
    if len(points) >= 2:
        mean_n = statistics.fmean(n for n, _ in points)
        mean_t = statistics.fmean(t for _, t in points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread
        fixed = mean_t - slope * mean_n
        if slope > 0 and fixed >= 0:
            return fixed, slope
    return 0.0, max(statistics.median(history[units]), 1e-6) / units


def step_time(units: Sequence[int], costs: Sequence[Cost]) -> float:
    """The slowest rank's predicted time for its units."""
    return max(fixed + per_unit * n for n, (fixed, per_unit) in zip(units, costs))


def fastest_shares(costs: Sequence[Cost], total: int, most: int) -> list[int]:
    """`total` units over ranks of the given costs, 1 to `most` each, so that the slowest finishes first.

    Greedy: every rank starts with one unit and each further unit goes to the rank that would finish it
    soonest. This minimises the largest finishing time; ties go to the lower rank, so every rank decides alike.
    """
    if total > most * len(costs) or total < len(costs):
        raise ValueError(f"{total} units cannot be split over {len(costs)} ranks at 1 to {most} each")
    units = [1] * len(costs)
    queue = [(fixed + 2 * per_unit, rank) for rank, (fixed, per_unit) in enumerate(costs)]
    heapq.heapify(queue)
    for _ in range(total - len(costs)):
        _, rank = heapq.heappop(queue)
        units[rank] += 1
        if units[rank] < most:
            fixed, per_unit = costs[rank]
            heapq.heappush(queue, (fixed + (units[rank] + 1) * per_unit, rank))
    return units

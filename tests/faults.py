"""Fault injection for the tests that prove mmpt survives faults: ranks load this module with
`launch/train.py ... --import faults` (`ARGS`, with `environment(fault)` putting tests/ on their path), and it
registers with the engine's step hooks (`mmpt.engine.hooks.observe`) when MMPT_INJECT_FAULT is set.

    MMPT_INJECT_FAULT="kill@save:after_engine,step=4,rank=1"     SIGKILL this rank at that point
    MMPT_INJECT_FAULT="sleep=30@forward,step=3,rank=1"           sleep there (a hung or slow rank)
    MMPT_INJECT_FAULT="nan@backward,step=3,rank=0"               make the loss about to be backpropagated NaN
    MMPT_INJECT_FAULT="fail@save:after_engine,step=4,rank=1"     raise OSError there (e.g. a full disk)
    MMPT_INJECT_FAULT="slow_compute:rank=1:factor=2"             this rank's own work takes twice as long
    MMPT_INJECT_FAULT="slow_collectives:rank=1:delay=0.05"       its collectives return 0.05 s late (a slow link)

Several faults are separated by `;`. A fault without `step`/`rank` fires at every step / on every rank;
`once=PATH` makes it fire only while PATH does not exist (it is created first), so a restarted run
gets past it. The points are those `mmpt.engine.hooks` is told of.

The two slowdowns last the whole run and are what rank health (`mmpt.engine.resilience.health`, on with
`train.rank_health`) must tell apart. `slow_compute` sleeps, at each point of the loop and before each
collective starts, `factor - 1` times the time since the previous point or collective, less the time spent in
collectives in between (which `mmpt.engine.resilience.collective_timing` counts): the rank works slower and
reaches every collective late, those inside backward (bucketed gradient reductions) too, as a slower
accelerator would. `slow_collectives` sleeps after each synchronous collective returns, inside the time the
collective is timed for: the rank's collectives end after its peers', as when the data it waits for crosses
a slow link.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mmpt.engine import hooks
from mmpt.engine.resilience import collective_timing

ENV = "MMPT_INJECT_FAULT"
ARGS = ["--import", "faults"]  # after the config and any overrides
TESTS = Path(__file__).resolve().parent


def environment(fault: str) -> dict[str, str]:
    """What the launcher's environment adds for ranks that carry out `fault`: the fault, and tests/ on the path."""
    path = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {ENV: fault, "PYTHONPATH": os.pathsep.join(path)}


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None
    once: str | None = None


SLOWDOWNS = ("slow_compute", "slow_collectives")
STEP_POINTS = ("data", "forward", "backward", "step", "log")  # the loop's points; eval and checkpoints break the chain


@dataclass(frozen=True)
class Slowdown:
    kind: str  # one of SLOWDOWNS
    rank: int | None = None
    factor: float = 2.0  # slow_compute: how many times as long this rank's own work takes
    delay: float = 0.05  # slow_collectives: seconds added to each synchronous collective


def parse_slowdown(item: str) -> Slowdown:
    """`slow_compute:rank=1:factor=2` or `slow_collectives:rank=1:delay=0.05`."""
    kind, *options = item.split(":")
    where = dict(option.split("=", 1) for option in options)
    unknown = set(where) - {"rank", "factor", "delay"}
    if unknown:
        raise ValueError(f"{ENV}: unknown option(s) {sorted(unknown)} in '{item}'")
    return Slowdown(
        kind,
        int(where["rank"]) if "rank" in where else None,
        float(where.get("factor", 2.0)),
        float(where.get("delay", 0.05)),
    )


def parse_slowdowns(text: str) -> list[Slowdown]:
    return [parse_slowdown(item) for item in _items(text) if item.split(":", 1)[0] in SLOWDOWNS]


def _items(text: str) -> list[str]:
    return [part.strip() for part in text.split(";") if part.strip()]


def parse(text: str) -> list[Fault]:
    faults = []
    for item in _items(text):
        if item.split(":", 1)[0] in SLOWDOWNS:
            continue
        head, *conditions = item.split(",")
        action, _, point = head.partition("@")
        where = dict(condition.split("=", 1) for condition in conditions)
        faults.append(
            Fault(
                action,
                point,
                int(where["step"]) if "step" in where else None,
                int(where["rank"]) if "rank" in where else None,
                where.get("once"),
            )
        )
    return faults


class FaultInjector:
    """Carries out the faults configured for this rank as the run reaches their points."""

    def __init__(self, faults: list[Fault], rank: int, slowdowns: list[Slowdown] | None = None):
        self.faults, self.rank = faults, rank
        self._poison_next_loss = False
        mine = [s for s in slowdowns or [] if s.rank in (None, rank)]
        self._compute = next((s for s in mine if s.kind == "slow_compute"), None)
        self._last: tuple[str, float, float] | None = None  # (point, time, collective seconds) at the last point
        self._delays: list = []  # what this injector added to collective_timing (`close` removes it)
        if self._compute is not None:
            factor = self._compute.factor
            self._delays.append(lambda kind: self._slow_down(None, factor))
            collective_timing.add_late_start(self._delays[-1])
        for slowdown in mine:
            if slowdown.kind == "slow_collectives":
                self._delays.append(lambda kind, seconds=slowdown.delay: time.sleep(seconds))
                collective_timing.add_delay(self._delays[-1])

    def close(self) -> None:
        """Stop slowing this process's collectives (the pool of ranks trains other runs after this one)."""
        for delay in self._delays:
            collective_timing.remove_delay(delay)
        self._delays = []

    @classmethod
    def from_environment(cls, rank: int) -> FaultInjector | None:
        text = os.environ.get(ENV, "")
        faults, slowdowns = parse(text), parse_slowdowns(text)
        return cls(faults, rank, slowdowns) if faults or slowdowns else None

    def reached(self, point: str, step: int) -> None:
        if self._compute is not None:
            self._slow_down(point, self._compute.factor)
        self._fire(point, step)

    def _slow_down(self, point: str | None, factor: float) -> None:
        """Stretch this rank's own work since the previous point of the step, or collective, by `factor`.
        `point` None: a collective is about to start; it stretches inside a step but keeps the last point's
        name, so that evaluation and checkpoints (which break the chain) stay unstretched."""
        clock = collective_timing.active()
        in_collectives = clock.seconds_so_far if clock is not None else 0.0
        if point is None:
            if self._last is None:
                return
            name, stretch = self._last[0], self._last[0] in STEP_POINTS
        else:
            name, stretch = point, self._last is not None and point in STEP_POINTS and self._last[0] in STEP_POINTS
        if stretch and self._last is not None:
            own = time.perf_counter() - self._last[1] - (in_collectives - self._last[2])
            time.sleep((factor - 1) * max(0.0, own))
        self._last = (name, time.perf_counter(), in_collectives)

    def _fire(self, point: str, step: int) -> None:
        for fault in self.faults:
            if fault.point != point or fault.step not in (None, step) or fault.rank not in (None, self.rank):
                continue
            if fault.once is not None:
                if os.path.exists(fault.once):
                    continue
                open(fault.once, "w").close()
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.action == "fail":
                raise OSError(f"injected write failure at {point}, step {step}")
            if fault.action.startswith("sleep="):
                time.sleep(float(fault.action.split("=", 1)[1]))
            if fault.action == "nan":
                self._poison_next_loss = True
            return

    def loss(self, total: torch.Tensor) -> torch.Tensor:
        if not self._poison_next_loss:
            return total
        self._poison_next_loss = False
        return total * float("nan")


def install_from_environment() -> None:
    """Register the faults MMPT_INJECT_FAULT asks for with the step hooks of every run this process starts."""
    injector = FaultInjector.from_environment(int(os.environ.get("RANK", "0")))
    if injector is not None:
        hooks.observe(injector.reached, injector.loss)


install_from_environment()

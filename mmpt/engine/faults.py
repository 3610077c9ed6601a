"""Fault injection, for the tests that prove mmpt survives faults. Installed only when MMPT_INJECT_FAULT is set.

    MMPT_INJECT_FAULT="kill@save:after_engine,step=4,rank=1"     SIGKILL this rank at that point
    MMPT_INJECT_FAULT="sleep=30@forward,step=3,rank=1"           sleep there (a hung or slow rank)
    MMPT_INJECT_FAULT="nan@backward,step=3,rank=0"               make the loss about to be backpropagated NaN
    MMPT_INJECT_FAULT="fail@save:after_engine,step=4,rank=1"     raise OSError there (e.g. a full disk)

Several faults are separated by `;`. A fault without `step`/`rank` fires at every step / on every rank;
`once=PATH` makes it fire only while PATH does not exist (it is created first), so a restarted run
gets past it. The points are those `mmpt.engine.hooks` is told of.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

ENV = "MMPT_INJECT_FAULT"


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None
    once: str | None = None


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
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

    def __init__(self, faults: list[Fault], rank: int):
        self.faults, self.rank = faults, rank
        self._poison_next_loss = False

    @classmethod
    def from_environment(cls, rank: int) -> FaultInjector | None:
        faults = parse(os.environ.get(ENV, ""))
        return cls(faults, rank) if faults else None

    def reached(self, point: str, step: int) -> None:
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

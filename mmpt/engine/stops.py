"""Expected stops: the ways a run ends on purpose, each with a documented exit code (docs/running.md's table) and one
line per rank.

A stop that every rank finds alike (config, non-finite) is said in full by rank 0; the others say
one short line. A data or checkpoint error belongs to one rank's readers or files, so each rank that
has one says it (for a checkpoint, the others say which ranks failed).
A rank that loses its peers because one of them stopped says so in one line. `MMPT_DEBUG=1` shows
the traceback of every stop instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mmpt.config import ConfigError
from mmpt.data.shards import DataError, MissingDataError
from mmpt.engine.checkpoint.protocol import CheckpointError
from mmpt.engine.guards import NonFiniteError
from mmpt.engine.resilience.health import UnhealthyRankError
from mmpt.models.tensor_files import CheckpointMismatch

EXIT_UNEXPECTED, EXIT_CONFIG, EXIT_DATA, EXIT_NON_FINITE, EXIT_CHECKPOINT, EXIT_HANG = 1, 2, 3, 4, 5, 75
EXIT_UNHEALTHY = 76
# Errors a surviving rank gets from its collective library when a peer process is gone.
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


@dataclass(frozen=True)
class Stop:
    kind: str
    exit_code: int
    same_on_every_rank: bool


STOPS: dict[type[Exception], Stop] = {  # the first that matches wins
    ConfigError: Stop("config error", EXIT_CONFIG, True),
    MissingDataError: Stop("data error", EXIT_CONFIG, False),
    CheckpointMismatch: Stop("config error", EXIT_CONFIG, True),  # init_from weights that do not fit the model
    DataError: Stop("data error", EXIT_DATA, False),
    NonFiniteError: Stop("non-finite training", EXIT_NON_FINITE, True),
    CheckpointError: Stop("checkpoint error", EXIT_CHECKPOINT, False),
    UnhealthyRankError: Stop("unhealthy rank", EXIT_UNHEALTHY, True),  # every rank judges the same gathered times
}


def say(line: str) -> None:
    """`mmpt: <line>` on stderr in one write: ranks share the launcher's pipe, and a print's separate
    writes of text and newline can interleave with another rank's."""
    os.write(2, f"mmpt: {line}\n".encode())


def debugging() -> bool:
    return os.environ.get("MMPT_DEBUG", "") not in ("", "0")


def classify(exc: BaseException) -> Stop | None:
    for kind, stop in STOPS.items():
        if isinstance(exc, kind):
            return stop
    return None


def peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in text for marker in PEER_LOST)


def one_line(text: object) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


@dataclass(frozen=True)
class Ending:
    line: str
    exit_code: int
    linger_s: float = 0.0  # wait before exiting, so the launcher sees the rank that stopped first


def ending(exc: BaseException, rank: int) -> Ending | None:
    """How this rank ends on an expected stop (its one line, exit code); None for anything else."""
    stop = classify(exc)
    if stop is not None:
        if rank == 0 or not stop.same_on_every_rank:
            prefix = "" if rank == 0 else f"rank {rank}: "
            return Ending(f"{prefix}{stop.kind}: {one_line(exc)}", stop.exit_code)
        # Lingering lets rank 0 say it: a launcher that sees this rank end first kills the others at once.
        return Ending(f"rank {rank}: stopped on the {stop.kind} that rank 0 reports", stop.exit_code, linger_s=3.0)
    if peer_lost(exc):
        # Launchers report the exit code of whichever failed process they notice first (DeepSpeed's polls
        # every second): lingering lets them notice, and report, the rank that stopped for a reason.
        return Ending(
            f"rank {rank}: stopped because another rank ended the run (see its line)", EXIT_UNEXPECTED, linger_s=5.0
        )
    return None

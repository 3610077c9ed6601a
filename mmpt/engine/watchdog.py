"""Hang watchdog: every rank reports its progress; one that makes none for `timeout` seconds says
where every rank is and ends the run with EXIT_HANG, so the launcher or scheduler can restart it.

Progress is a (step, phase) pair (phases: data, forward, backward, step, log, checkpoint; the
collectives of a step happen in backward and step). The training loop only notes it in memory; the
watchdog's thread writes the newest one to `<run_dir>/heartbeats/rank_<r>.json` when it checks (once a
second; more often only for timeouts under 10 s), with the time it was noted, so the step does no file
I/O and a shared filesystem sees at most one small write per rank and second. A rank stuck in a phase
has written that phase within a second of entering it. The lagging ranks are those furthest behind, or, when
all are at the same point, those silent longest: a rank stuck in a collective waits for exactly those.

Rank 0 says the diagnosis: the other ranks wait `grace` seconds longer before they act, so a hang
ends with one report from rank 0 (and the launcher stops the rest), unless rank 0 itself cannot
report (its process frozen or gone).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from mmpt.engine.stops import EXIT_HANG, say

log = logging.getLogger(__name__)

PHASES = ("data", "forward", "backward", "step", "log", "checkpoint")


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout: float):
        self.folder = run_dir / "heartbeats"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.patience = timeout if rank == 0 else timeout + max(10.0, timeout / 2)
        self._progress, self._last = (0, "start", time.time()), time.monotonic()
        self._written: tuple | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mmpt-watchdog", daemon=True)
        if timeout > 0:
            self._write()
            self._thread.start()

    def beat(self, step: int, phase: str) -> None:
        """Note progress (in memory only: the watchdog's thread writes it out)."""
        self._progress = (step, phase, time.time())  # one assignment: the thread never sees half of it
        self._last = time.monotonic()

    def reached(self, point: str, step: int) -> None:
        """A step hook (`mmpt.engine.hooks`): the step's phases are progress; the save protocol's inner points
        (`save:...`) are not, the "checkpoint" phase before them covers the save."""
        if ":" not in point:
            self.beat(step, point)

    @property
    def step(self) -> int:
        return self._progress[0]

    @property
    def phase(self) -> str:
        return self._progress[1]

    def _write(self) -> None:
        """The newest progress to this rank's heartbeat file, if it changed since the last write."""
        report = self._progress
        if report == self._written:
            return
        path = self.folder / f"rank_{self.rank}.json"
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps({"rank": self.rank, "step": report[0], "phase": report[1], "time": report[2]}))
        temporary.replace(path)
        self._written = report

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 10)):
            self._write()
            silent = time.monotonic() - self._last
            if silent > self.patience:
                say(self.diagnosis(silent))
                os._exit(EXIT_HANG)

    def diagnosis(self, silent: float) -> str:
        reports = self._read_all()
        now = time.time()

        def progress(report: dict) -> tuple[int, int]:
            phase = report["phase"]
            return report["step"], PHASES.index(phase) if phase in PHASES else -1

        lagging: list[dict] = []
        if reports:
            least = min(progress(r) for r in reports)
            lagging = [r for r in reports if progress(r) == least]
            if len(lagging) == len(reports):  # all at the same point: the silent ones hold the rest up
                oldest = min(r["time"] for r in reports)
                lagging = [r for r in reports if r["time"] - oldest < 1.0]
        missing = sorted(set(range(self.world_size)) - {r["rank"] for r in reports})
        where = "; ".join(
            f"rank {r['rank']}: step {r['step']} {r['phase']}, silent {now - r['time']:.0f}s"
            for r in sorted(reports, key=lambda r: r["rank"])
        )
        names = ", ".join(str(r["rank"]) for r in lagging) or "unknown"
        return (
            f"watchdog: rank {self.rank} made no progress for {silent:.0f}s (> {self.timeout:.0f}s) in "
            f"'{self.phase}' of step {self.step}; lagging rank(s): {names}"
            f"{'; no heartbeat from rank(s) ' + str(missing) if missing else ''}. All ranks: {where}. "
            f"{'' if self.rank == 0 else 'Rank 0 did not report. '}"
            f"Exiting with {EXIT_HANG}; restart to resume from the latest checkpoint."
        )

    def _read_all(self) -> list[dict]:
        reports = []
        for rank in range(self.world_size):
            try:
                reports.append(json.loads((self.folder / f"rank_{rank}.json").read_text()))
            except (OSError, ValueError):
                continue
        return reports

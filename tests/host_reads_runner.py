"""Count the host reads mmpt's own code makes during training steps (each rank runs this; see test_host_reads.py).

    deepspeed --num_gpus 2 tests/host_reads_runner.py CELLS.json RESULTS.jsonl

A host read is what makes a GPU step wait for the device: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`int()`/`float()`/`bool()` of a tensor, formatting one, `torch.cuda.synchronize()`. On CPU ranks they cost
nothing, but the same calls would each stall a GPU, so they are counted wherever the calling line is
in mmpt's code (mmpt/, data/, losses/); reads inside torch or DeepSpeed are theirs. Counting is on
from the start of step 2 to the end of every step that neither logs nor saves a checkpoint (the
engine's phases, seen through `mmpt.engine.hooks.observing`, tell where a step is). Each rank writes one JSON line
per cell: the reads it saw ("op at file:line": count) and the steps it counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUR_CODE = tuple(f"{REPO / part}{os.sep}" for part in ("mmpt", "data", "losses"))
READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "__format__")


class HostReads:
    """Installed once per process; `reset` before each cell."""

    def __init__(self):
        self.reset(set())

    def reset(self, quiet_steps: set[int], extra_code: tuple[str, ...] = ()) -> None:
        self.quiet_steps = quiet_steps  # steps that neither log nor checkpoint
        self.code = OUR_CODE + extra_code
        self.counting = False
        self.counted_steps: set[int] = set()
        self.seen: Counter[str] = Counter()

    def install(self) -> None:
        for name in READS:
            setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), name))
        if torch.cuda.is_available():
            torch.cuda.synchronize = self._counted(torch.cuda.synchronize, "torch.cuda.synchronize")

    def _counted(self, original, name: str):
        def read(*args, **kwargs):
            if self.counting:
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(self.code):
                    where = caller.f_code.co_filename.removeprefix(f"{REPO}{os.sep}")
                    self.seen[f"{name} at {where}:{caller.f_lineno}"] += 1
            return original(*args, **kwargs)

        return read

    def phase(self, point: str, step: int) -> None:
        if point == "data":
            self.counting = step >= 2 and step in self.quiet_steps
            if self.counting:
                self.counted_steps.add(step)
        elif point in ("log", "checkpoint"):
            self.counting = False


def run_cell(cell: dict, results: Path, reads: HostReads) -> None:
    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.engine.hooks import observing

    cfg = load_config(cell["config"], [*cell["overrides"], f"run.output_dir={cell['run_dir']}"])
    quiet = {
        s
        for s in range(1, cfg.train.max_steps + 1)
        if s % cfg.train.log_every
        and s != cfg.train.max_steps
        and not (cfg.train.save_every and s % cfg.train.save_every == 0)
    }
    import deepspeed

    # ZeRO 1-2 steps make no read in DeepSpeed's code either (deepspeed_private.skip_on_device)
    theirs = (str(Path(deepspeed.__file__).parent) + os.sep,) if cfg.train.zero_stage in (1, 2) else ()
    reads.reset(quiet, theirs)
    try:
        with observing(reads.phase):
            train(cfg)
    finally:
        reads.counting = False
    with results.open("a") as out:
        out.write(
            json.dumps(
                {
                    "cell": cell["name"],
                    "rank": mdist.get_rank(),
                    "reads": dict(reads.seen),
                    "counted_steps": sorted(reads.counted_steps),
                }
            )
            + "\n"
        )
    mdist.barrier()


def main(argv: list[str]) -> int:
    import logging

    cells_file, results = (Path(a) for a in argv if not a.startswith("--local_rank"))
    logging.basicConfig(level=logging.WARNING)
    reads = HostReads()
    reads.install()
    for cell in json.loads(cells_file.read_text()):
        print(f"host-read cell: {cell['name']}", flush=True)
        run_cell(cell, results, reads)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run several config-matrix cells in one launcher start (each rank runs this; see test_config_matrix.py).

    deepspeed --num_gpus 2 tests/matrix_runner.py CELLS.json RESULTS.jsonl

Every cell is a config file and dotted overrides. A cell trains 2 steps (checkpoint at step 2; its
data.eval sets evaluated at step 1 and at the end), resumes from that checkpoint for a third step, then
rank 0 exports the newest checkpoint with
mmpt-export (launch/export.py), loads the release with `mmpt.load` and checks its weights against the run's own
consolidated model.safetensors. One JSON line per finished cell goes to RESULTS.jsonl; a failing
cell ends the run with its name printed, so the test can say which one broke.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cell(cell: dict, results: Path) -> None:
    import torch
    from safetensors.torch import load_file

    import mmpt
    from conftest import read_metrics  # this script's folder, tests/, is on sys.path
    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    run_dir = Path(cell["run_dir"])
    started = time.perf_counter()
    common = [*cell["overrides"], f"run.output_dir={run_dir}", "train.save_every=2"]
    train(load_config(cell["config"], [*common, "train.max_steps=2"]))
    train(load_config(cell["config"], [*common, "train.max_steps=3"]))  # resumes from step 2
    if mdist.get_rank() == 0:
        records = read_metrics(run_dir)
        steps = [r["step"] for r in records if "loss/total" in r]
        assert steps == [1, 2, 3], f"logged steps {steps}: the second start did not resume at step 2"
        losses = {r["step"]: r["loss/total"] for r in records if "loss/total" in r}
        assert all(math.isfinite(v) for v in losses.values()), losses
        evaluated = [r["step"] for r in records if any(key.startswith("eval/") for key in r)]
        assert evaluated == [1, 2, 3], f"evaluations at steps {evaluated}, not at 1 (eval_every) and at each end"
        release = run_dir.parent / f"{run_dir.name}-release"
        from mmpt.commands.export import main as export

        assert export(["--run", str(run_dir), "--out", str(release), "--checkpoint", "latest"]) == 0
        exported = mmpt.load(release).model.state_dict()
        final = load_file(str(run_dir / "model.safetensors"))
        assert exported.keys() == final.keys(), sorted(set(exported) ^ set(final))[:5]
        for key, value in final.items():
            torch.testing.assert_close(
                exported[key].float(), value.float(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}"
            )
        with results.open("a") as out:
            out.write(
                json.dumps({"cell": cell["name"], "seconds": round(time.perf_counter() - started, 1), "losses": losses})
                + "\n"
            )
    mdist.barrier()


def main(argv: list[str]) -> int:
    import logging

    cells_file, results = (Path(a) for a in argv if not a.startswith("--local_rank"))
    logging.basicConfig(level=logging.WARNING)
    for cell in json.loads(cells_file.read_text()):
        print(f"matrix cell: {cell['name']}", flush=True)
        run_cell(cell, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The shared pool of ranks: every rank runs this once and trains a queue of scenarios in one launcher start.

    deepspeed --num_gpus 2 tests/pool_runner.py SCENARIOS.json RESULTS.jsonl

A scenario is a config file, dotted overrides and a kind:
- "train": one `mmpt.engine.train(cfg)` call; the test reads the run folder afterwards.
- "stop_at:N": a first start trains to step N (its `train.max_steps`), a second one resumes to the config's end
  (a scenario's faults in both).
- "matrix": a config-matrix cell: trains 2 steps (checkpoint at step 2; its data.eval sets evaluated at step 1
  and at the end), resumes from that checkpoint for a third step, then rank 0 exports the newest checkpoint
  with mmpt-export, loads the release with `mmpt.load` and checks its weights against the run's own
  consolidated model.safetensors.
One JSON line per finished scenario goes to RESULTS.jsonl; a failing scenario ends the run with its name
printed, so the test can say which one broke (starting the launcher again for the rest would cost more than
the suite can spend).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

# A scenario that stops making progress ends the pool after 10 minutes, not the default half hour: the slowest
# step here (a first compiled step on two loaded cores) takes a few minutes, and a scenario's own setting wins.
WATCHDOG = "train.watchdog_timeout=600"


def run_matrix_cell(config: str, overrides: list[str], run_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    import mmpt
    from conftest import read_metrics  # this script's folder, tests/, is on sys.path
    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    common = [WATCHDOG, *overrides, f"run.output_dir={run_dir}", "train.save_every=2"]
    train(load_config(config, [*common, "train.max_steps=2"]))
    train(load_config(config, [*common, "train.max_steps=3"]))  # resumes from step 2
    if mdist.get_rank() != 0:
        return {}
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records if "loss/total" in r]
    assert steps == [1, 2, 3], f"logged steps {steps}: the second start did not resume at step 2"
    losses = {r["step"]: r["loss/total"] for r in records if "loss/total" in r}
    assert all(math.isfinite(v) for v in losses.values()), losses
    evaluated = [r["step"] for r in records if any(key.startswith("eval/") for key in r)]
    assert evaluated == [1, 2, 3], f"evaluations at steps {evaluated}, not at 1 (eval_every) and at each end"
    release = run_dir.parent / f"{run_dir.name}-release"
    from mmpt.commands.export import main as export

    # --keep-lora: the run's own layout, so that it compares bit for bit (tests/test_lora.py checks the merge)
    assert export(["--run", str(run_dir), "--out", str(release), "--checkpoint", "latest", "--keep-lora"]) == 0
    exported = mmpt.load(release).model.state_dict()
    final = load_file(str(run_dir / "model.safetensors"))
    assert exported.keys() == final.keys(), sorted(set(exported) ^ set(final))[:5]
    for key, value in final.items():
        torch.testing.assert_close(exported[key].float(), value.float(), rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    return {"losses": losses}


def replaced_collectives() -> list[str]:
    """Collectives of torch.distributed and of DeepSpeed's backend object that are not the libraries' own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from mmpt.engine import deepspeed_private

    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier")
    backend = deepspeed_private.comm_backend()
    return [f"torch.distributed.{n}" for n in names if getattr(dist, n) is not getattr(distributed_c10d, n)] + [
        f"cdb.{n}"
        for n in names
        if backend is not None and n in vars(backend)  # DeepSpeed's are class methods
    ]


class Said(logging.Handler):
    """What a scenario's run says on this rank, as its lines: mmpt's log messages (INFO and above) and what it
    prints (the metric lines, through `printed`, which still reach the console). A test reads them from the
    scenario's record."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.printed = _Tee(self.lines, sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Tee:
    """sys.stdout that also keeps what is written to it, as lines; the console answers everything else."""

    def __init__(self, lines: list[str], console):
        self.lines, self.console = lines, console

    def write(self, text: str) -> int:
        self.lines += text.splitlines()
        return self.console.write(text)

    def __getattr__(self, name: str):
        return getattr(self.console, name)


def train_with_faults(cfg, spec: str) -> dict:
    """`train(cfg)` while this rank carries out `spec` (tests/faults.py); a run that stops as expected gives
    every rank's one line and exit code (what `launch/train.py` would say and return) instead of raising."""
    import faults
    import torch.distributed as dist

    from mmpt import distributed as mdist
    from mmpt.engine import stops, train
    from mmpt.engine.hooks import observing

    rank = int(os.environ["RANK"])  # the launcher's: the process group may start only inside train()
    injector = faults.FaultInjector(faults.parse(spec), rank, faults.parse_slowdowns(spec))
    ending = None
    with observing(injector.reached, injector.loss):
        try:
            train(cfg)
        except Exception as exc:
            ending = stops.ending(exc, rank)
            if ending is None:
                raise
        finally:
            injector.close()
    said: list = [None] * mdist.get_world_size()
    dist.all_gather_object(said, None if ending is None else (ending.line, ending.exit_code))
    return {"stops": said}


def run_scenario(scenario: dict, results: Path) -> None:
    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.engine.hooks import observing

    started = time.perf_counter()
    run_dir = Path(scenario["run_dir"])
    replaced: set[str] = set()  # what stood in for a library's collective while a step ran
    said = Said()

    def during_step(point: str, step: int) -> None:
        if point == "backward":
            replaced.update(replaced_collectives())

    logging.getLogger("mmpt").addHandler(said)
    with observing(during_step), contextlib.redirect_stdout(said.printed):  # type: ignore[arg-type]
        if scenario["kind"] == "matrix":
            record = run_matrix_cell(scenario["config"], scenario["overrides"], run_dir)
        else:
            overrides = [WATCHDOG, *scenario["overrides"], f"run.output_dir={run_dir}"]

            def start(cfg) -> dict:  # the scenario's faults, if any, are carried out by each start
                if scenario.get("fault"):
                    return train_with_faults(cfg, scenario["fault"])
                train(cfg)
                return {}

            if scenario["kind"].startswith("stop_at:"):
                stop = int(scenario["kind"].split(":")[1])
                start(load_config(scenario["config"], [*overrides, f"train.max_steps={stop}"]))
            record = start(load_config(scenario["config"], overrides))
    logging.getLogger("mmpt").removeHandler(said)
    if mdist.get_rank() == 0:
        record = {
            "name": scenario["name"],
            "run_dir": str(run_dir),
            "seconds": round(time.perf_counter() - started, 1),
            "replaced_collectives": sorted(replaced),
            "said": said.lines,
            **record,
        }
        with results.open("a") as out:
            out.write(json.dumps(record) + "\n")
    mdist.barrier()


def main(argv: list[str]) -> int:
    scenarios_file, results = (Path(a) for a in argv if not a.startswith("--local_rank"))
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mmpt").setLevel(logging.INFO)  # what a run says, as `mmpt-train` shows it
    from conftest import freeze_what_training_imports

    freeze_what_training_imports()
    for scenario in json.loads(scenarios_file.read_text()):
        print(f"pool scenario: {scenario['name']}", flush=True)
        run_scenario(scenario, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The `data.eval` sets, evaluated every `train.eval_every` steps and at the end of training.

The evaluation at the end reads the run's consolidated weights on rank 0 and records that it completed
(`final_evaluation.json`): a run whose evaluation failed (a set that could not be read, the job stopped during it)
evaluates when it is started again, instead of saying that it has nothing left to do.

Evaluation while training must leave training exactly as it would have been without it: the RNG streams (Python,
NumPy, torch, CUDA) and every module's train/eval mode are put back, no parameter is written, and the
training loader is not touched. Under ZeRO-3 every rank gathers the parameters for the duration of the
evaluation (in the training precision) instead of one rank building a whole fp32 copy; every rank runs
the evaluation, so none waits in a collective while another evaluates, and rank 0 reports it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.artifacts import FINAL_EVALUATION, WEIGHTS, atomic_write
from mmpt.config import Config
from mmpt.engine.checkpoint import read_weights
from mmpt.engine.checkpoint.rng import rng_state, set_rng_state
from mmpt.methods import Method
from mmpt.methods.base import save_eval_record


def evaluate_sets(
    method: Method, model: nn.Module, cfg: Config, run_dir: Path, records: Path | None = None
) -> dict[str, float]:
    """{eval/<set>/<language>/<metric>: value, eval/<set>/seconds: time} of every `data.eval` set; with `records`,
    each set's result in each language is also written there as a CLIP_benchmark-style record (the end of
    training writes them to <run>/eval/, which the model card shows) and the methods' costlier protocols run."""
    results: dict[str, float] = {}
    for eval_set in cfg.data.eval:
        started = time.perf_counter()
        for language in eval_set.languages:
            record = method.evaluate_set(model, cfg, run_dir, eval_set, language, final=records is not None)
            if records is not None:
                save_eval_record(record, records, name=eval_set.label)
            results.update(
                {
                    f"eval/{eval_set.label}/{language}/{name}": value
                    for name, value in record["metrics"].items()
                    if isinstance(value, (int, float))
                }
            )
        results[f"eval/{eval_set.label}/seconds"] = round(time.perf_counter() - started, 3)
    return results


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Every RNG stream and module mode as they were before the block, whatever it did."""
    rng = rng_state()
    modes = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        set_rng_state(rng)


def evaluate_while_training(method: Method, model: nn.Module, cfg: Config, run_dir: Path) -> dict[str, Any]:
    """`evaluate_sets` on the model being trained (every rank calls it), leaving training untouched."""
    gathered = nullcontext()
    if cfg.train.zero_stage == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    with untouched(model), gathered, torch.no_grad():
        model.eval()
        return evaluate_sets(method, model, cfg, run_dir)


def final_evaluation_due(cfg: Config, run_dir: Path, step: int) -> str | None:
    """Why the evaluation at the end is still to run at `step` (None: it ran, or `cfg` has none): it did not
    complete, it ran at an earlier end (the run trained on), or it covered other sets than `cfg` names."""
    sets = [s.label for s in cfg.data.eval]
    record = run_dir / FINAL_EVALUATION
    if not sets:
        return None
    if not record.is_file():
        return "its final evaluation did not complete"
    done = json.loads(record.read_text())
    if done.get("step") != step:
        return f"its final evaluation was at step {done.get('step')}"
    if done.get("sets") != sets:
        return f"its final evaluation covered {', '.join(done.get('sets') or [])}, the config names {', '.join(sets)}"
    return None


def final_evaluation(cfg: Config, method: Method, run_dir: Path, device: torch.device, step: int) -> dict[str, Any]:
    """Every `data.eval` set, on a model loaded from the run's consolidated weights; recorded in
    `final_evaluation.json` once every set is evaluated."""
    model = read_weights(method.build_model(cfg, run_dir), run_dir / WEIGHTS).to(device).eval()
    with torch.no_grad():
        results = evaluate_sets(method, model, cfg, run_dir, records=run_dir / "eval")
    record = {"step": step, "sets": [s.label for s in cfg.data.eval], "metrics": results}
    atomic_write(run_dir / FINAL_EVALUATION, json.dumps(record, indent=1))
    if results:
        print(
            "final evaluation: " + ", ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in results.items()),
            flush=True,
        )
    return results

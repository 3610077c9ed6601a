"""The one training loop of mmpt. Methods plug in model, loss, data and evaluation; `run.Run` holds the rest."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import operator
from pathlib import Path
from typing import Any

import torch

from mmpt import distributed as mdist
from mmpt.config import Config
from mmpt.engine import run as runs
from mmpt.engine.evaluation import evaluate_while_training, final_evaluation, final_evaluation_due
from mmpt.engine.hooks import StepHooks
from mmpt.engine.optim import SkippingAdamW
from mmpt.engine.resilience import collective_timing
from mmpt.engine.resilience.health import HealthMonitor
from mmpt.engine.timing import Spans
from mmpt.engine.zero3.guard import partitioned_parameter_guard
from mmpt.methods import get_method
from mmpt.methods.base import diagnostics, loss_terms


def train(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to `train.max_steps` (resuming if asked); returns the final evaluation metrics."""
    run, step = runs.start(cfg)
    if run is None:
        return evaluate_finished(cfg, step)
    health = HealthMonitor.start(cfg.train, run.run_dir, run.engine.device.type == "cuda")
    if health is not None:
        run.hooks.observers.append(health.reached)
    try:
        with mdist.using(run.collectives):  # the run's layout, row counts and gather clock, for its losses
            train_steps(run, health)
    except BaseException:
        run.metrics.close()
        raise
    finally:
        if health is not None:
            collective_timing.uninstall()
        run.close()
    try:
        return finish(run)
    finally:
        run.metrics.close()


def train_steps(run: runs.Run, health: HealthMonitor | None) -> None:
    """The loop: a step, then what is due after it (a log window, an evaluation, a checkpoint), to the last step."""
    cfg, first_step = run.cfg, run.step
    while run.step < cfg.train.max_steps:
        # Under ZeRO-3 the first step of a process is checked for parameters used while partitioned.
        check = run.step == first_step and cfg.train.zero_stage == 3
        with partitioned_parameter_guard(run.engine.module, f"step {run.step + 1}", active=check):
            losses = train_step(run)
        run.step += 1
        run.guard.update(step_skipped(run.engine))
        run.metrics.update(losses)
        if run.due(cfg.train.log_every):
            log_window(run, health)
        if run.eval_due():
            run.hooks.reached("eval", run.step)
            run.metrics.write_eval(
                run.step, evaluate_while_training(run.method, run.engine.module.model, cfg, run.run_dir)
            )
            run.hooks.reached("eval", run.step)
        # A stop on an unhealthy rank is planned: the step it stops at is saved, so the restart loses none.
        if run.due(cfg.train.save_every) or (health is not None and health.stops):
            run.hooks.reached("checkpoint", run.step)
            run.checkpointer.save(run.engine, run.step)
        if health is not None:
            health.act(run.step)  # warns, or stops the run (every rank alike)


def train_step(run: runs.Run) -> dict[str, torch.Tensor]:
    """One optimizer step: the micro-batches read, forward and backward, the step, the momentum copies."""
    at = run.step + 1
    run.spans.start("data")
    run.hooks.reached("data", at)  # inside the span: an injected slow loader shows in data time
    units = run.shares.mine if run.shares is not None else None
    micro_batches = [
        to_device(run.batches.take(units), run.engine.device, run.float_dtype) for _ in range(run.cfg.train.grad_accum)
    ]
    run.spans.stop("data")
    if not run.flops_counted:
        run.count_flops(micro_batches[0])
    weight = run.shares.loss_weight() if run.shares is not None else 1.0
    losses = optimizer_step(run.engine, micro_batches, run.hooks, at, run.spans, weight)
    if (run.needs.after_step or run.needs.momentum_copies) and run.engine.was_step_applied():
        after_optimizer_step(run)
    return losses


def log_window(run: runs.Run, health: HealthMonitor | None = None) -> None:
    """The logging window's metrics, reduced over ranks and written (a collective); unhealthy ranks judged."""
    run.hooks.reached("log", run.step)
    times = run.spans.take()  # waits for the window's work: the one host sync of a logging window
    per_rank = health.window(run.step) if health is not None else None  # one gather of collective timings
    if run.shares is not None and per_rank is not None:
        per_rank["micro_batch_per_rank"] = run.shares.samples()  # the shares this window ran at
        if health is not None and health.judged:  # a window with evaluation or a checkpoint says less
            run.shares.update(per_rank["busy_time_per_rank"])
    loader = run.batches.loader
    record = run.metrics.log_window(
        run.step,
        run.engine.get_lr()[0],
        times,
        loader.counts_by_source(),
        loader.source_names,
        run.guard.read(),
        run.state_bytes(),
        per_rank,
    )
    if health is not None:
        run.metrics.health_summary = health.summary()
    run.guard.check(run.step, {k.removeprefix("loss/"): v for k, v in record.items() if k.startswith("loss/")})


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype) -> Any:
    """Move a (nested) batch to the device; floating tensors take the training precision."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype=float_dtype if batch.is_floating_point() else None, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


def after_optimizer_step(run: runs.Run) -> None:
    """The momentum copies' EMA step, then the method's after-step work, each with the parameters it reads
    whole on this rank under ZeRO-3."""
    import deepspeed

    if run.momentum is not None:
        run.momentum.update()
    else:
        for copy in run.needs.momentum_copies:
            copy.update()
    for work in run.needs.after_step:
        reads = list(work.reads()) if run.cfg.train.zero_stage == 3 else []
        if reads:
            with deepspeed.zero.GatheredParameters(reads, modifier_rank=None):
                work.run()
        else:
            work.run()


def step_skipped(engine) -> torch.Tensor | bool:
    """Whether the optimizer step just taken was skipped for non-finite values: at ZeRO 0-2 a device tensor
    `SkippingAdamW` left (not read here; at ZeRO 1-2 it is inside DeepSpeed's optimizer), else DeepSpeed's
    answer (it has read its overflow flag)."""
    optimizer = engine.optimizer
    skipping = optimizer if isinstance(optimizer, SkippingAdamW) else getattr(optimizer, "optimizer", None)
    if isinstance(skipping, SkippingAdamW):
        return skipping.skipped if skipping.skipped is not None else False
    return not engine.was_step_applied()


def optimizer_step(
    engine,
    micro_batches: list[dict[str, Any]],
    hooks: StepHooks | None = None,
    step: int = 0,
    spans: Spans | None = None,
    weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Forward/backward every micro-batch and step: each loss term averaged over them, as device tensors
    (nothing is read back to the host). `spans` times each forward ("forward"; the loss's gathers time
    themselves as "gather"); `hooks` are told where step `step` is (forward, backward, step). `weight`
    multiplies this rank's losses: its share of the global batch when ranks hold uneven shares."""
    hooks = hooks or StepHooks([])
    spans = spans or Spans(cuda=False)
    pool = None
    pooling = engine.module.pooling
    if pooling == "merged":  # one pass over all (DeepSpeed then accumulates nothing)
        passes = [functools.partial(engine, micro_batches, entry="merged")]
    else:  # each: forward, backward, step
        if pooling == "separate":
            hooks.reached("forward", step)
            trace = engine.module.pool_trace
            with torch.no_grad(), trace.pool_pass() if trace is not None else contextlib.nullcontext():
                pool = engine(micro_batches, entry="pool")
        passes = [functools.partial(engine, batch, pool, index) for index, batch in enumerate(micro_batches)]
    sums: dict[str, torch.Tensor] = {}
    loss_names: set[str] = set()  # the loss terms among the sums (the rest are the method's diagnostics)
    reduction = engine.module.gradient_reduction
    if reduction is not None:
        reduction.start_step()
    for index, forward in enumerate(passes):
        hooks.reached("forward", step)
        spans.start("forward")
        terms = forward()
        losses = loss_terms(terms)
        loss_names.update(losses)
        if weight != 1.0:
            losses = {name: value * weight for name, value in losses.items()}
        spans.stop("forward")
        hooks.reached("backward", step)
        total = hooks.loss(functools.reduce(operator.add, losses.values()))
        last = index == len(passes) - 1
        if reduction is not None:
            reduction.reduce_during_backward(last)
        # With a pool every micro-batch loss is the step's loss: its gradients are summed, not averaged. DeepSpeed
        # divides by the accumulation steps, at ZeRO-0 even when told not to (`scale_wrt_gas=False`: its forward's
        # output hooks divide instead), so the pooled loss is multiplied by them first.
        engine.backward(total * engine.gradient_accumulation_steps() if pool is not None else total)
        if reduction is not None and last:
            engine.optimizer.take_found_inf(reduction.finish())
        hooks.reached("step", step)
        engine.step()
        for name, value in {**diagnostics(terms), **losses}.items():
            share = value.detach() / len(passes)
            sums[name] = sums[name] + share if name in sums else share
    sums["total"] = functools.reduce(operator.add, (v for k, v in sums.items() if k in loss_names))
    return sums


def finish(run: runs.Run) -> dict[str, Any]:
    """Consolidated fp32 weights, then the method's evaluation on a model loaded back from them.

    The run holds the only reference to the engine: once the weights are written it is freed, so the
    evaluation model does not sit in accelerator memory beside the training one.
    """
    run.metrics.end_progress()
    run.checkpointer.write_weights(run.engine.module.model)
    device = run.engine.device
    free_engine(run.engine)
    run.engine = None
    mdist.barrier()
    if mdist.get_rank() != 0 or final_evaluation_due(run.cfg, run.run_dir, run.step) is None:
        return {}
    results = final_evaluation(run.cfg, run.method, run.run_dir, device, run.step)
    if results:
        run.metrics.write_final(run.step, results)
    return results


def evaluate_finished(cfg: Config, step: int) -> dict[str, Any]:
    """A finished run started again: its final evaluation on rank 0 if it had not completed, else nothing."""
    method, run_dir = get_method(cfg.method_name), Path(cfg.run.output_dir)
    if mdist.get_rank() != 0 or final_evaluation_due(cfg, run_dir, step) is None:
        return {}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    results = final_evaluation(cfg, method, run_dir, device, step)
    if results:
        with (run_dir / "metrics.jsonl").open("a") as records:
            records.write(json.dumps({"step": step, **results}) + "\n")
    return results


def free_engine(engine) -> None:
    """Free what the engine holds (DeepSpeed's buffers, the optimizer state); the caller drops the last reference."""
    engine.destroy()
    engine.optimizer = engine.lr_scheduler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

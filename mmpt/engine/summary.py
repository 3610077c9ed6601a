"""What a run is about to do, said once on rank 0 before the first step: the block a user reads to catch a
wrong layout, batch, starting point or data mix before it costs a day."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from mmpt import distributed as mdist
from mmpt.config import Config
from mmpt.data.loader import StatefulLoader
from mmpt.data.shards import count_samples
from mmpt.engine.pool_pass import Pooling

POOL_PASSES = {"merged": "one pass with gradient", "separate": "a pool pass without gradient first"}


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """The model's parameters: all of them, those that train, and those of these in LoRA adapters; whole even
    where ZeRO-3 has partitioned them (`ds_numel`). A run's summary.json keeps them for its model card."""
    counts = {"total": 0, "trained": 0, "adapters": 0}
    for name, parameter in model.named_parameters():
        count = getattr(parameter, "ds_numel", parameter.numel())
        counts["total"] += count
        if parameter.requires_grad:
            counts["trained"] += count
            counts["adapters"] += count if "lora_" in name else 0
    return counts


def startup_summary(
    cfg: Config,
    parameters: dict[str, int],
    layout: mdist.ParallelLayout,
    loader: StatefulLoader,
    initial_weights: str | None,
    start_step: int,
    resumed_from: Path | None,
    pooling: Pooling = None,
    method_lines: Sequence[str] = (),
) -> str:
    """`parameters`: the model's `parameter_counts`. `pooling`: how a step pooling its micro-batches for the loss
    runs them (`mmpt.engine.pool_pass`). `method_lines`: the method's own (`Method.summary_lines`)."""
    world = mdist.get_world_size()
    per_node = int(mdist.local_world_size())
    batch, accum = cfg.data.train.batch_size, cfg.train.grad_accum
    how = POOL_PASSES.get(pooling or "")
    pooled = [f"pooled accumulation: the loss over all {accum} micro-batches, {how} (train.pool_pass)"] if how else []
    lines = [
        f"ranks: {world} on {max(1, world // max(1, per_node))} node(s) of {per_node}"
        + (f", sequence parallel {layout.sequence_parallel}" if layout.sequence_parallel > 1 else ""),
        f"ZeRO stage {cfg.train.zero_stage}{' with optimizer offload' if cfg.train.offload_optimizer else ''}, "
        f"precision {cfg.train.precision}",
        f"batch: {batch} per rank x {accum} micro-batch(es) x {layout.data_size} data-parallel rank(s) = "
        f"{batch * accum * layout.data_size} samples per step, {cfg.train.max_steps} steps",
        *pooled,
        f"parameters: {parameters['total']:,} ({parameters['trained']:,} trainable"
        + (f", {parameters['adapters']:,} of them in LoRA adapters)" if parameters["adapters"] else ")"),
        *method_lines,
        learning_rate_line(cfg),
        f"initial weights: {initial_weights or 'random (the config names none)'}"
        + (" (at the run's start; the checkpoint's now)" if resumed_from is not None else ""),
    ]
    if resumed_from is not None:
        lines.append(f"resuming from {resumed_from} at step {start_step}")
    for source, spec in zip(cfg.data.train.sources, loader.dataset.spec.sources):
        samples = count_samples(spec.urls)
        keys = ", ".join(f"{name}_key={getattr(source, f'{name}_key')}" for name in source.fields_set())
        lines.append(
            f"source {spec.name!r}: {len(spec.urls)} shard(s)"
            + (f", {samples:,} samples" if samples is not None else "")
            + f", weight {spec.weight:g}"
            + (f", {keys}" if keys else "")
            + (f", text {source.text_encoding}" if source.text_encoding != "utf-8" else "")
        )
    lines.append(checkpoint_line(cfg))
    if cfg.data.eval:
        when = f"every {cfg.train.eval_every} steps and at the end" if cfg.train.eval_every else "at the end"
        sets = ", ".join(f"{s.label} ({s.task}, {'/'.join(s.languages)})" for s in cfg.data.eval)
        lines.append(f"evaluation {when}: {sets}")
    lines.append(f"output: {Path(cfg.run.output_dir).resolve()}")
    return "run summary\n" + "\n".join(f"  {line}" for line in lines)


def checkpoint_line(cfg: Config) -> str:
    """When checkpoints are written: every `train.save_every` steps where the run has that many, and at the end."""
    every, steps = cfg.train.save_every, cfg.train.max_steps
    when = f"every {every} steps and at the end" if 0 < every < steps else "at the end"
    return f"checkpoints {when} (keep {cfg.train.keep_last})"


def learning_rate_line(cfg: Config) -> str:
    """The peak learning rate, its per-parameter scales, and whether the run is long enough to reach it."""
    optim = cfg.optim
    return (
        f"learning rate {optim.lr:g}"
        + "".join(f", x{scale:g} for {pattern}" for pattern, scale in optim.lr_scales.items())
        + (
            f", layer decay {optim.layer_decay:g} (x{optim.layer_decay:g}^k, k blocks below a tower's head)"
            if optim.layer_decay
            else ""
        )
        + (
            f", never reached: optim.warmup_steps {optim.warmup_steps} > train.max_steps {cfg.train.max_steps}"
            if optim.warmup_steps > cfg.train.max_steps
            else ""
        )
    )

"""Everything one training run holds, built once: the process group and layout, the DeepSpeed engine, what the
method needs from the engine, the batches, the checkpointer with the run's stateful parts registered, the
metrics, the step hooks. `trainer.train` drives it; nothing is threaded through the loop by hand."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.artifacts import WEIGHTS
from mmpt.config import Config, ConfigError, save_config
from mmpt.data.loader import SkipPolicy, StatefulLoader
from mmpt.engine import deepspeed_private, precision
from mmpt.engine.batch_norm import RunningStatisticsKept, batch_norm_across_ranks
from mmpt.engine.checkpoint import Checkpointer, RngState, deepspeed_io, find_resume, saved_step, saved_world_size
from mmpt.engine.compile import check_compile, compile_towers, compiles
from mmpt.engine.deepspeed_config import check_precision, deepspeed_config
from mmpt.engine.evaluation import final_evaluation_due
from mmpt.engine.flops import flops_per_sample, peak_tflops, step_flops
from mmpt.engine.grad_buckets import BucketedAllReduce
from mmpt.engine.guards import NonFiniteGuard
from mmpt.engine.hooks import StepHooks
from mmpt.engine.metrics import MetricLogger
from mmpt.engine.optim import SkippingAdamW, build_optimizer, optimizer_state_bytes, skips_on_device, warmup_cosine
from mmpt.engine.pool_pass import Pooling, step_pooling
from mmpt.engine.preflight import check_inputs
from mmpt.engine.resilience.adaptive_batch import BatchShares, check_adaptive_batch
from mmpt.engine.sequence_parallel import split_sequences
from mmpt.engine.summary import parameter_counts, startup_summary
from mmpt.engine.timing import Spans
from mmpt.engine.watchdog import Watchdog
from mmpt.engine.zero3.build import build_partitioned
from mmpt.engine.zero3.copies import ShardedCopies, momentum_bytes
from mmpt.engine.zero3.pool_trace import PoolTrace
from mmpt.methods import EngineNeeds, Method, get_method

log = logging.getLogger(__name__)
Entry = Literal["step", "pool", "merged"]


class TrainingModule(nn.Module):
    """Model + loss as one module, with what the method needs from the engine (`needs`). Every method hook
    that reads parameters (the step pool, `training_step`) runs inside this module's forward, and the
    engine calls it only through DeepSpeed's forward: that is where ZeRO-3 gathers partitioned
    parameters, including ones read as tensors outside a module call."""

    def __init__(self, method: Method, model: nn.Module, loss: nn.Module, needs: EngineNeeds):
        super().__init__()
        self.method, self.model, self.loss, self.needs = method, model, loss, needs
        self.gradient_reduction: BucketedAllReduce | None = None  # set by `build_engine` where it replaces DeepSpeed's
        self.pool_trace: PoolTrace | None = None  # set by `build_engine` for a method with a step pool
        self.autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype): bf16 at ZeRO-0 (`precision`)
        self._replay: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # RNG states of the pool pass, by index
        self.pooling: Pooling = None  # set by `build_engine` (`mmpt.engine.pool_pass.step_pooling`)

    def forward(self, batch: Any, pool: Any = None, index: int = 0, entry: Entry = "step") -> Any:
        """`entry` "step": one micro-batch's training step (with the step's pool, if any); "pool": the pool pass
        and "merged": `needs.merged_step`, both over the step's list of micro-batches."""
        if self.autocast is None:
            return self._forward(batch, pool, index, entry)
        device_type, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype):
            return self._forward(batch, pool, index, entry)

    def _forward(self, batch: Any, pool: Any, index: int, entry: Entry) -> Any:
        if entry == "pool":
            return self._pool(batch)
        if entry == "merged":
            assert self.needs.merged_step is not None
            return self.needs.merged_step(self.model, self.loss, batch)
        if pool is not None:
            set_torch_rng(self._replay[index])  # the draws its pool pass made: the same masks, the same features
        return self.method.training_step(self.model, self.loss, batch, pool, index)

    def _pool(self, micro_batches: list[Any]) -> Any:
        assert self.needs.pool_features is not None and self.needs.step_pool is not None
        features, self._replay = [], []
        with RunningStatisticsKept(self.model):
            for batch in micro_batches:
                self._replay.append(torch_rng())
                features.append(self.needs.pool_features(self.model, batch))
        return self.needs.step_pool(self.loss, features)


def torch_rng() -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's host and current-device generator states (host-side values: reading them does not sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_torch_rng(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    host, device = state
    torch.set_rng_state(host)
    if device is not None:
        torch.cuda.set_rng_state(device)


class Batches:
    """The loader as the loop reads it, and the data position as a checkpoint part: a loaded position starts
    the loader's iterator before the RNG part is restored (starting it draws from the RNG)."""

    def __init__(self, loader: StatefulLoader):
        self.loader = loader
        self._iterator: Iterator | None = None

    def start(self) -> None:
        self._iterator = iter(self.loader)

    def __next__(self) -> Any:
        assert self._iterator is not None, "Batches.start() first"
        return next(self._iterator)

    def take(self, units: int | None = None) -> Any:
        """The next micro-batch: one delivery, or `units` loader units collated together (adaptive batches)."""
        if units is None:
            return next(self)
        return self.loader.combine([next(self) for _ in range(units)])

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self.start()

    def load_resharded(self, states: Sequence[dict[str, Any]], step: int) -> None:
        """Readers saved by another layout, one per data-parallel rank (sequence-parallel ranks share one)."""
        self.loader.reshard(list(states[:: len(states) // states[0]["world_size"]]))
        self.start()


@dataclass
class Run:
    cfg: Config
    method: Method
    run_dir: Path
    layout: mdist.ParallelLayout
    engine: Any  # the DeepSpeed engine; None once `trainer.finish` has freed it
    batches: Batches
    checkpointer: Checkpointer
    hooks: StepHooks
    metrics: MetricLogger
    watchdog: Watchdog
    momentum: ShardedCopies | None  # momentum copies sharded like their parameters (ZeRO-3), else None
    float_dtype: torch.dtype
    step: int = 0
    shares: BatchShares | None = None  # per-rank micro-batches under train.adaptive_batch
    flops_counted: bool = False  # whether `count_flops` has run
    guard: NonFiniteGuard = field(init=False)
    spans: Spans = field(init=False)
    collectives: mdist.Collectives = field(init=False)  # current while the run trains (`mdist.using`)

    def __post_init__(self) -> None:
        self.guard = NonFiniteGuard(self.cfg.train.max_bad_steps, self.engine.device)
        self.spans = Spans(cuda=self.engine.device.type == "cuda")
        self.collectives = mdist.Collectives(self.layout, uneven_rows=self.shares is not None, spans=self.spans)

    @property
    def needs(self) -> EngineNeeds:
        return self.engine.module.needs

    @property
    def rank(self) -> int:
        return mdist.get_rank()

    def due(self, every: int) -> bool:
        """Whether the step just taken is one of every `every` (0: never), or the last."""
        return (bool(every) and self.step % every == 0) or self.step == self.cfg.train.max_steps

    def eval_due(self) -> bool:
        """Evaluation while training: every `train.eval_every` steps, but not at the end (`finish` evaluates)."""
        every, last = self.cfg.train.eval_every, self.cfg.train.max_steps
        return bool(self.cfg.data.eval) and bool(every) and self.step % every == 0 and self.step < last

    def state_bytes(self) -> tuple[float, float | None]:
        """This rank's bytes of optimizer state and of momentum copies (None when the model keeps none)."""
        copies = self.needs.momentum_copies
        return (
            float(optimizer_state_bytes(self.engine.optimizer, self.engine.module)),
            float(momentum_bytes(copies)) if copies else None,
        )

    def count_flops(self, batch: Any) -> None:
        """Once, with the first micro-batch (before it runs): the step's FLOPs per sample, counted on fake tensors
        of its shapes (`mmpt.engine.flops`), for the metrics' perf/tflops and perf/mfu. Only where a peak is known."""
        self.flops_counted = True
        if self.metrics.peak_tflops is None:
            return
        samples = self.shares.mine * self.shares.unit if self.shares is not None else self.cfg.data.train.batch_size
        clock = self.metrics.clock
        started = clock.mark()
        self.metrics.flops_per_sample = flops_per_sample(
            lambda: step_flops(self.method, self.cfg, self.run_dir, batch), samples
        )
        self.metrics.exclude(clock.seconds(started, clock.mark()))  # counting is not the window's training time

    def close(self) -> None:
        self.watchdog.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def start(cfg: Config) -> tuple[Run | None, int]:
    """(the run, ready to train from its step; None when it already finished) and the step it stands at."""
    deepspeed_private.check_version()
    check_precision(cfg)
    check_adaptive_batch(cfg)
    method = get_method(cfg.method_name)
    check_inputs(cfg, method)  # before the process group: a missing file is one line and exit 2, not a requeue
    rank, world_size = start_process_group(cfg.train.watchdog_timeout)
    precision.use_tf32(cfg.train.tf32)
    layout = mdist.set_sequence_parallel(cfg.train.sequence_parallel)
    run_dir = Path(cfg.run.output_dir)
    if rank == 0:
        prepare_run_dir(cfg, method, run_dir)
    mdist.barrier()

    checkpoint = find_resume(run_dir, cfg.run.resume)
    # Finished: its final checkpoint and weights are written (rank 0's word: other nodes may not share its disk).
    # Told before the engine is built: restarting a finished run loads nothing.
    step = 0 if checkpoint is None else saved_step(checkpoint)
    if step >= cfg.train.max_steps and mdist.all_gather_floats([(run_dir / WEIGHTS).is_file()])[0][0]:
        if rank == 0:
            due = final_evaluation_due(cfg, run_dir, step)
            print(
                f"mmpt: {run_dir} already finished at step {step} (train.max_steps={cfg.train.max_steps}): "
                + (
                    f"{due}; evaluating now"
                    if due
                    else "nothing to do; raise train.max_steps to train on, or set run.output_dir to start another run"
                ),
                flush=True,
            )
        return None, step
    elastic = checkpoint is not None and saved_world_size(checkpoint) != world_size
    universal = None
    if checkpoint is not None and elastic and cfg.train.zero_stage > 0:
        universal = deepspeed_io.to_universal(checkpoint, run_dir)
    engine, initial_weights, momentum = build_engine(
        cfg, method, layout, world_size, load_universal=universal is not None
    )
    float_dtype = set_training_precision(engine, cfg)

    seed_everything(cfg.train.seed + layout.data_rank)  # ranks splitting one batch draw the same masks
    loader = StatefulLoader(
        method.train_data(cfg, run_dir, rank=layout.data_rank, world_size=layout.data_size),
        SkipPolicy(cfg.data.train.max_skip_rate, cfg.data.train.min_samples_for_skip_rate),
    )
    batches = Batches(loader)
    shares = BatchShares.of(cfg, layout.data_size, layout.data_rank)
    if shares is not None:
        loader.read_in_units(shares.unit)
    watchdog = Watchdog(run_dir, rank, world_size, cfg.train.watchdog_timeout)
    hooks = StepHooks([watchdog.reached])
    spec = loader.dataset.spec
    checkpointer = Checkpointer(
        run_dir, cfg.train.keep_last, (spec.world_size, spec.num_workers), hooks.reached, partitioned=momentum
    )
    checkpointer.register("data", batches)
    if shares is not None:
        checkpointer.register("batch_shares", shares)
    checkpointer.register("rng", RngState(lambda at: seed_everything(cfg.train.seed + layout.data_rank + 7919 * at)))

    if checkpoint is None:
        batches.start()
    else:
        step, saved = checkpointer.restore(engine, checkpoint, universal or checkpoint)
        if rank == 0:
            same = saved == checkpointer.layout
            log.warning(
                "resumed from %s at step %d"
                + ("" if same else ", saved by %d ranks x %d workers, on %d x %d: data readers restart at epoch %d"),
                checkpoint,
                step,
                *(() if same else (*saved, spec.world_size, spec.num_workers, spec.start_epoch)),
            )
    parameters = parameter_counts(engine.module.model)
    if rank == 0:
        pooling = engine.module.pooling
        summary = startup_summary(
            cfg, parameters, layout, loader, initial_weights, step, checkpoint, pooling, method.summary_lines(cfg)
        )
        log.info(summary)

    global_batch = cfg.data.train.batch_size * cfg.train.grad_accum * layout.data_size
    metrics = MetricLogger(
        run_dir,
        max_steps=cfg.train.max_steps,
        start_step=step,
        global_batch=global_batch,
        tensorboard=cfg.run.tensorboard,
        progress_bar=cfg.run.progress_bar,
        wandb=cfg.run.wandb,
        config=cfg.to_dict(),
        gpu=engine.device.type == "cuda",
        data_group=layout.data_group,
        peak_tflops=peak_tflops(cfg.train.peak_tflops, cfg.train.precision, engine.device),
    )
    metrics.parameters = parameters
    return Run(
        cfg,
        method,
        run_dir,
        layout,
        engine,
        batches,
        checkpointer,
        hooks,
        metrics,
        watchdog,
        momentum,
        float_dtype,
        step,
        shares,
    ), step


def start_process_group(watchdog_timeout: float) -> tuple[int, int]:
    """NCCL on GPUs, gloo on CPU; a plain `python` start becomes a world of one. Every group's collectives
    wait longer than the hang watchdog (`mdist.group_timeout`), so the watchdog is the one to report a hang."""
    import deepspeed

    mdist.ensure_rendezvous_env()
    use_cuda = torch.cuda.is_available()
    timeout = mdist.group_timeout(watchdog_timeout)
    mdist.set_default_group_timeout(timeout)
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", timeout=timeout)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mdist.barrier()
    deepspeed_private.release_cpu_allreduce_buffer(mdist.get_rank())
    return mdist.get_rank(), mdist.get_world_size()


def prepare_run_dir(cfg: Config, method: Method, run_dir: Path) -> None:
    """Rank 0: demo data if asked, the resolved config, and the method's files (tokenizer)."""
    if cfg.data.prepare:
        from mmpt import demo

        demo.build(cfg.data.prepare, cfg.data.root)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    method.prepare(cfg, run_dir)


def set_training_precision(engine: Any, cfg: Config) -> torch.dtype:
    """The engine's module in the run's precision: buffers in the model's float type, the modules a method keeps
    in fp32 (and the momentum copies) computing in fp32. Returns the float type the batches take."""
    float_dtype = precision.policy(cfg.train.precision, cfg.train.zero_stage).model
    needs = engine.module.needs
    kept_fp32 = needs.fp32_modules + needs.momentum_copies
    precision.match_buffer_precision(engine.module, float_dtype, kept_fp32)
    precision.compute_in(kept_fp32, float_dtype, engine.device.type)
    return float_dtype


def loss_with_teacher(cfg: Config, method: Method, world_size: int, load_universal: bool) -> nn.Module:
    """The method's loss, around the frozen teacher it names (`Method.teacher`) where it names one: built like
    the model, partitioned under ZeRO-3 on several ranks."""
    loss, teacher = method.build_loss(cfg), method.teacher(cfg)
    if teacher is None:
        return loss
    seed_everything(cfg.train.seed)
    if cfg.train.zero_stage == 3 and world_size > 1:
        ds_config = deepspeed_config(cfg, world_size, load_universal=load_universal)
        model, loaded, _ = build_partitioned(teacher.build, teacher.load, teacher.tensors(), lambda _: [], ds_config)
    else:
        model = teacher.build()
        loaded = teacher.load(model)
    if loaded:
        log.info(f"teacher: {loaded}")
    return teacher.around(loss, model)


def build_engine(
    cfg: Config, method: Method, layout: mdist.ParallelLayout, world_size: int, load_universal: bool = False
) -> tuple[Any, str | None, ShardedCopies | None]:
    """(DeepSpeed engine, what `Method.load_initial_weights` said it loaded or None, the momentum copies
    sharded under ZeRO-3 or None)."""
    import deepspeed

    check_compile(cfg)

    def build() -> nn.Module:
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        return method.build_model(cfg, Path(cfg.run.output_dir))

    momentum = None
    if cfg.train.zero_stage == 3 and world_size > 1:
        model, loaded, momentum = build_partitioned(
            build,
            lambda whole: method.load_initial_weights(whole, cfg),
            method.initial_tensors(cfg),
            lambda built: method.engine_needs(built, cfg).momentum_copies,
            deepspeed_config(cfg, world_size, load_universal=load_universal),
        )
    else:
        model = build()
        loaded = method.load_initial_weights(model, cfg)
    model.train()
    needs = method.engine_needs(model, cfg)
    if needs.batch_norm_across_ranks:
        batch_norm_across_ranks(model, layout.data_group)
    if layout.sequence_parallel > 1:
        if not needs.sequence_parallel:
            raise ConfigError(
                f"config key 'train.sequence_parallel': method '{method.name}' declares no transformer "
                "to split along the sequence; set it to 1"
            )
        assert layout.sequence_group is not None  # formed whenever sequence parallelism is on
        split_sequences(needs.sequence_parallel, layout.sequence_group, layout.sequence_parallel)
    if compiles(cfg, needs, gpu=torch.cuda.is_available()):
        # in place: parameter names, so checkpoints, stay those of eager runs
        compile_towers(needs, method.name, cfg.train.zero_stage)
    module = TrainingModule(method, model, loss_with_teacher(cfg, method, world_size, load_universal), needs)
    module.pooling = step_pooling(cfg, needs, model)
    optimizer = build_optimizer(module.model, cfg.optim, needs.tower_groups, skips_on_device(cfg.train))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio, cfg.optim.decay)
    )
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    if isinstance(optimizer, SkippingAdamW):
        deepspeed_private.accept_zero_optimizer(SkippingAdamW)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=cast(Any, schedule),  # DeepSpeed's annotation names torch's older _LRScheduler
        config=deepspeed_config(
            cfg, world_size, load_universal=load_universal, parameters=parameters, one_pass=module.pooling == "merged"
        ),
    )
    if cfg.train.zero_stage in (1, 2) and isinstance(optimizer, SkippingAdamW):
        deepspeed_private.skip_on_device(engine.optimizer, optimizer)
    if module.pooling == "separate":
        module.pool_trace = PoolTrace(engine)
    autocast = precision.policy(cfg.train.precision, cfg.train.zero_stage).autocast
    if autocast is not None:
        module.autocast = (cast(torch.device, engine.device).type, autocast)
    if momentum is None and cfg.train.zero_stage == 3 and needs.momentum_copies:  # one rank: partitioned just now
        momentum = ShardedCopies(needs.momentum_copies)
    if cfg.train.zero_stage == 0 and (world_size == 1 or isinstance(engine.optimizer, SkippingAdamW)):
        # Averaging over one rank: nothing to do. Over several, with the plain (fp32) optimizer: buckets that
        # reduce while backward runs, without DeepSpeed's flatten and copy back (see grad_buckets.py).
        engine.enable_backward_allreduce = False
        if world_size > 1:
            module.gradient_reduction = BucketedAllReduce(module.parameters())
    return engine, loaded, momentum

"""The one training loop of mmpt. Methods plug in model, loss, data and evaluation; this owns the rest."""

from __future__ import annotations

import gc
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.config import Config, ConfigError, save_config
from mmpt.data import counts as data_counts
from mmpt.data.loader import SkipPolicy, StatefulLoader
from mmpt.engine import checkpoint, faults, precision, shm_collectives
from mmpt.engine.batch_norm import batch_norm_across_ranks
from mmpt.engine.evaluation import evaluate_sets, evaluate_while_training
from mmpt.engine.deepspeed_config import check_precision, deepspeed_config
from mmpt.engine.grad_buckets import BucketedAllReduce
from mmpt.engine.guards import NonFiniteGuard
from mmpt.engine.metrics import MetricLogger
from mmpt.engine.sequence_parallel import split_sequences
from mmpt.engine.sharded_copies import ShardedCopies, momentum_bytes
from mmpt.engine.timing import Spans
from mmpt.engine.preflight import check_inputs
from mmpt.engine.summary import startup_summary
from mmpt.engine.optim import SkippingAdamW, build_optimizer, optimizer_state_bytes, warmup_cosine
from mmpt.engine.watchdog import Watchdog
from mmpt.engine.zero3_guard import partitioned_parameter_guard
from mmpt.methods import EngineNeeds, Method, get_method

log = logging.getLogger(__name__)


class TrainingModule(nn.Module):
    """Model + loss as one module, with what the method needs from the engine (`needs`). Every method hook
    that reads parameters (the step pool, `training_step`) runs inside this module's forward, and the
    engine calls it only through DeepSpeed's forward: that is where ZeRO-3 gathers partitioned
    parameters, including ones read as tensors outside a module call."""

    def __init__(self, method: Method, model: nn.Module, loss: nn.Module, needs: EngineNeeds):
        super().__init__()
        self.method, self.model, self.loss, self.needs = method, model, loss, needs
        self.gradient_reduction: BucketedAllReduce | None = None  # set by `build_engine` where it replaces DeepSpeed's

    def forward(self, batch: Any, pool: Any = None, index: int = 0, pool_pass: bool = False) -> Any:
        if pool_pass:  # `batch` is then the step's list of micro-batches
            return self.needs.step_pool(self.model, self.loss, batch)
        return self.method.training_step(self.model, self.loss, batch, pool, index)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype) -> Any:
    """Move a (nested) batch to the device; floating tensors take the training precision."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype=float_dtype if batch.is_floating_point() else None, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


def after_optimizer_step(needs: EngineNeeds, zero_stage: int, sharded: ShardedCopies | None) -> None:
    """The momentum copies' EMA step, then the method's after-step work, each with the parameters it reads
    whole on this rank under ZeRO-3."""
    import deepspeed

    if sharded is not None:
        sharded.update()
    else:
        for copy in needs.momentum_copies:
            copy.update()
    for work in needs.after_step:
        reads = list(work.reads()) if zero_stage == 3 else []
        if reads:
            with deepspeed.zero.GatheredParameters(reads, modifier_rank=None):
                work.run()
        else:
            work.run()


def check_pooled_accumulation(method: Method, model: nn.Module, grad_accum: int) -> None:
    """Pooled accumulation is exact only if both passes over a micro-batch compute the same features:
    refuse modules whose training-mode forward is random (dropout, drop-path) or counts each batch
    (batch norm statistics would be updated twice)."""
    if method.engine_needs(model).step_pool is None or grad_accum == 1:
        return
    for name, module in model.named_modules():
        reason = None
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            reason = f"dropout p={module.p}"
        elif isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            reason = f"attention dropout {module.dropout}"
        elif isinstance(getattr(module, "drop_prob", None), float) and module.drop_prob > 0:
            reason = f"drop-path {module.drop_prob}"
        elif isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            reason = "batch norm in training mode"
        if reason:
            raise ConfigError(f"method '{method.name}' pools train.grad_accum={grad_accum} micro-batches per step, which "
                              f"needs the same features in its pool and gradient passes, but model module '{name}' has "
                              f"{reason}: turn it off or set train.grad_accum=1")


def prepare_demo_data(cfg: Config) -> None:
    """The demo corpus `data.prepare` names, built under `data.root` on first use."""
    if cfg.data.prepare:
        from mmpt import demo

        demo.build(cfg.data.prepare, cfg.data.root)


def train(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to `train.max_steps` (resuming if asked); returns the final evaluation metrics."""
    check_precision(cfg)
    method = get_method(cfg.method_name)
    check_inputs(cfg, method)  # before the process group: a missing file is one line and exit 2, not a requeue
    rank, world_size = start_process_group()
    layout = mdist.set_sequence_parallel(cfg.train.sequence_parallel)
    run_dir = Path(cfg.run.output_dir)
    if rank == 0:
        prepare_run_dir(cfg, method, run_dir)
    mdist.barrier()

    checkpoint_dir = checkpoint.find_resume(run_dir, cfg.run.resume)
    elastic = checkpoint_dir is not None and checkpoint.saved_world_size(checkpoint_dir) != world_size
    universal = checkpoint.to_universal(checkpoint_dir, run_dir) if elastic and cfg.train.zero_stage > 0 else None
    engine, initial_weights = build_engine(cfg, method, run_dir, world_size, load_universal=universal is not None)
    float_dtype = precision.DTYPES[cfg.train.precision]
    needs = engine.module.needs
    kept_fp32 = needs.fp32_modules + needs.momentum_copies
    precision.match_buffer_precision(engine.module, float_dtype, kept_fp32)
    precision.compute_in(kept_fp32, float_dtype, engine.device.type)
    sharded = ShardedCopies(needs.momentum_copies) if cfg.train.zero_stage == 3 and needs.momentum_copies else None
    seed_everything(cfg.train.seed + layout.data_rank)  # ranks splitting one batch draw the same masks
    loader = StatefulLoader(
        method.train_data(cfg, run_dir, rank=layout.data_rank, world_size=layout.data_size),
        SkipPolicy(cfg.data.train.max_skip_rate, cfg.data.train.min_samples_for_skip_rate),
    )
    step, batches = resume(cfg, engine, loader, checkpoint_dir, universal or checkpoint_dir, sharded)
    # Finished: its final checkpoint and weights are written (rank 0's word: other nodes may not share its disk).
    finished = step >= cfg.train.max_steps and mdist.all_gather_floats([(run_dir / checkpoint.WEIGHTS).is_file()])[0][0]
    if finished:
        if rank == 0:
            print(f"mmpt: {run_dir} already finished at step {step} (train.max_steps={cfg.train.max_steps}): nothing "
                  "to do; raise train.max_steps to train on, or set run.output_dir to start another run", flush=True)
        return {}
    if rank == 0:
        log.info(startup_summary(cfg, engine.module.model, loader, initial_weights, step, checkpoint_dir))

    global_batch = cfg.data.train.batch_size * cfg.train.grad_accum * layout.data_size
    metrics = MetricLogger(run_dir, max_steps=cfg.train.max_steps, start_step=step, global_batch=global_batch,
                           tensorboard=cfg.run.tensorboard, progress_bar=cfg.run.progress_bar,
                           straggler_factor=cfg.train.straggler_factor, straggler_windows=cfg.train.straggler_windows,
                           wandb=cfg.run.wandb, config=cfg.to_dict())
    watchdog = Watchdog(run_dir, rank, world_size, cfg.train.watchdog_timeout)

    def reached(phase: str, at_step: int) -> str | None:
        watchdog.beat(at_step, phase)
        return faults.inject(phase, at_step, rank)  # no-op unless a test injects a fault here

    guard = NonFiniteGuard(cfg.train.max_bad_steps, engine.device)
    spans = mdist.GatherClock.spans = Spans(cuda=engine.device.type == "cuda")
    first_step = step
    try:
        while step < cfg.train.max_steps:
            spans.start("data")
            reached("data", step + 1)  # inside the span: an injected slow loader shows in data time
            micro_batches = [to_device(next(batches), engine.device, float_dtype) for _ in range(cfg.train.grad_accum)]
            spans.stop("data")
            # Under ZeRO-3 the first step of a process is checked for parameters used while partitioned.
            check = step == first_step and cfg.train.zero_stage == 3
            with partitioned_parameter_guard(engine.module, f"step {step + 1}", active=check):
                losses = optimizer_step(engine, micro_batches, lambda phase, at=step + 1: reached(phase, at), spans)
                if (needs.after_step or needs.momentum_copies) and engine.was_step_applied():
                    after_optimizer_step(needs, cfg.train.zero_stage, sharded)
            step += 1
            guard.update(step_skipped(engine))
            metrics.update(losses)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                reached("log", step)
                times = spans.take()  # waits for the window's work: the one host sync of a logging window
                metrics.data_counts = reduced_data_counts(loader)
                state_mib = mdist.all_gather_floats([optimizer_state_bytes(engine.optimizer, engine.module) / 2**20,
                                                     momentum_bytes(needs.momentum_copies) / 2**20])
                momentum = {"momentum_copy_mib_per_rank": [round(m[1], 3) for m in state_mib]} if needs.momentum_copies else {}
                record = metrics.reduce(step, engine.get_lr()[0], times, {
                    **data_counts.metrics(metrics.data_counts), "skipped_steps": guard.read(),
                    "optimizer_state_mib_per_rank": [round(m[0], 1) for m in state_mib], **momentum})
                metrics.write(step, record)
                guard.check(step, {k.removeprefix("loss/"): v for k, v in record.items() if k.startswith("loss/")})
            if cfg.data.eval and cfg.train.eval_every and step % cfg.train.eval_every == 0 \
                    and step < cfg.train.max_steps:  # the end of training evaluates in `finish`
                reached("eval", step)
                metrics.write_eval(step, evaluate_while_training(method, engine.module.model, cfg, run_dir))
                reached("eval", step)
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.max_steps:
                reached("checkpoint", step)
                state = {"data": loader.state_dict(), "rng": checkpoint.rng_state()}
                checkpoint.save(engine, run_dir, step, state, cfg.train.keep_last, sharded)
    except BaseException:
        metrics.close()
        raise
    finally:
        mdist.GatherClock.spans = None
        watchdog.close()
    handoff = [engine]  # finish() takes the only reference, to free the engine before evaluating
    del engine
    try:
        return finish(cfg, method, handoff, run_dir, step, sharded, metrics)
    finally:
        metrics.close()


def reduced_data_counts(loader: StatefulLoader) -> dict[str, dict[str, int]]:
    """Every rank's sample counts summed, {"all" or source: {...}} (a collective)."""
    sources = loader.source_names
    local = data_counts.flatten(loader.counts_by_source(), sources)
    summed = mdist.all_reduce_sum(torch.tensor(local, dtype=torch.float64), mdist.data_parallel_group()).tolist()
    return data_counts.nest(summed, sources)


def start_process_group() -> tuple[int, int]:
    """NCCL on GPUs, gloo on CPU; a plain `python` start becomes a world of one."""
    import deepspeed

    mdist.ensure_rendezvous_env()
    use_cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(mdist.process_info().local_rank)
    mdist.barrier()
    release_cpu_allreduce_buffer()
    if shm_collectives.route_deepspeed_collectives() and mdist.get_rank() == 0:
        log.info("all %d CPU ranks on this host: gradient all-reduces and ZeRO's gathers go through DeepSpeed's "
                 "shared-memory kernel", mdist.get_world_size())
    return mdist.get_rank(), mdist.get_world_size()


def release_cpu_allreduce_buffer() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer from /dev/shm once every rank has mapped it.

    DeepSpeed's shared-memory all-reduce (CPU ranks) creates one ~70 MB file per rank and run,
    named after the rendezvous port, and never removes it: every run, killed ones most of all,
    would leave its buffers behind until /dev/shm fills memory. Every peer maps all buffers while
    the process group starts (the barrier before this call), so the name is no longer needed;
    the memory goes when the last rank exits.
    """
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{mdist.get_rank()}")
    Path("/dev/shm", name).unlink(missing_ok=True)


def prepare_run_dir(cfg: Config, method: Method, run_dir: Path) -> None:
    """Rank 0: demo data if asked, the resolved config, and the method's files (tokenizer)."""
    prepare_demo_data(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    method.prepare(cfg, run_dir)


def build_engine(cfg: Config, method: Method, run_dir: Path, world_size: int, load_universal: bool = False):
    """(DeepSpeed engine, what `Method.load_initial_weights` said it loaded, or None)."""
    import deepspeed

    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    model = method.build_model(cfg, run_dir)
    check_pooled_accumulation(method, model.train(), cfg.train.grad_accum)
    loaded = method.load_initial_weights(model, cfg)
    needs = method.engine_needs(model)
    if needs.batch_norm_across_ranks:
        batch_norm_across_ranks(model, mdist.data_parallel_group())
    layout = mdist.layout()
    if layout.sequence_parallel > 1:
        if not needs.sequence_parallel:
            raise ConfigError(f"config key 'train.sequence_parallel': method '{method.name}' declares no transformer "
                              "to split along the sequence; set it to 1")
        split_sequences(needs.sequence_parallel, layout.sequence_group, layout.sequence_parallel)
    module = TrainingModule(method, model, method.build_loss(cfg), needs)
    optimizer = build_optimizer(module.model, cfg.optim, cfg.train.zero_stage)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio, cfg.optim.decay)
    )
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=schedule,
        config=deepspeed_config(cfg, world_size, load_universal=load_universal),
    )
    if cfg.train.zero_stage == 0 and (world_size == 1 or isinstance(engine.optimizer, SkippingAdamW)):
        # Averaging over one rank: nothing to do. Over several, with the plain (fp32) optimizer: buckets that
        # reduce while backward runs, without DeepSpeed's flatten and copy back (see grad_buckets.py).
        engine.enable_backward_allreduce = False
        if world_size > 1:
            module.gradient_reduction = BucketedAllReduce(module.parameters())
    return engine, loaded


def resume(cfg: Config, engine, loader: StatefulLoader, checkpoint_dir: Path | None,
           engine_checkpoint: Path | None, sharded: ShardedCopies | None = None) -> tuple[int, Iterator]:
    """(step, batch iterator), continuing where the checkpoint left off if there is one.

    Same ranks and workers: exactly (data position and RNG restored). Another layout: model and
    optimizer through DeepSpeed's universal checkpoint, data readers re-sharded (see
    `StatefulLoader.reshard`), RNG reseeded from the step.
    """
    if checkpoint_dir is None:
        return 0, iter(loader)
    step = checkpoint.load_engine(engine, engine_checkpoint)
    if engine_checkpoint != checkpoint_dir:  # a universal copy: it lacks the buffers
        checkpoint.load_buffers(engine, checkpoint_dir, sharded)
    states = checkpoint.rank_states(checkpoint_dir)
    rank = mdist.get_rank()
    layout = (states[0]["data"]["world_size"], states[0]["data"]["num_workers"])
    spec = loader.dataset.spec
    if layout == (spec.world_size, spec.num_workers):
        loader.load_state_dict(states[rank]["data"])
        batches = iter(loader)
        checkpoint.set_rng_state(states[rank]["rng"])  # after iter(): starting the loader draws from the RNG
        if rank == 0:
            log.warning("resumed from %s at step %d", checkpoint_dir, step)
        return step, batches
    readers = [s["data"] for s in states]
    loader.reshard(readers[::len(readers) // readers[0]["world_size"]])  # one per batch: sequence-parallel ranks share
    batches = iter(loader)
    seed_everything(cfg.train.seed + mdist.layout().data_rank + 7919 * step)
    if rank == 0:
        log.warning("resumed from %s at step %d, saved by %d ranks x %d workers, on %d x %d: data readers restart "
                    "at epoch %d", checkpoint_dir, step, *layout, spec.world_size, spec.num_workers, spec.start_epoch)
    return step, batches


def step_skipped(engine) -> torch.Tensor | bool:
    """Whether the optimizer step just taken was skipped for non-finite values: at ZeRO 0 a device tensor
    `SkippingAdamW` left (not read here), at ZeRO 1-3 DeepSpeed's answer (it has read its overflow flag)."""
    if isinstance(engine.optimizer, SkippingAdamW):
        return engine.optimizer.skipped if engine.optimizer.skipped is not None else False
    return not engine.was_step_applied()


def optimizer_step(engine, micro_batches: list[dict[str, Any]],
                   phase: Callable[[str], str | None] = lambda name: None,
                   spans: Spans | None = None) -> dict[str, torch.Tensor]:
    """Forward/backward every micro-batch and step: each loss term averaged over them, as device tensors
    (nothing is read back to the host). `spans` times each forward ("forward"; the loss's gathers time
    themselves as "gather").

    `phase(name)` is told where the step is (forward, backward, step), for the watchdog.
    """
    spans = spans or Spans(cuda=False)
    pool = None
    if engine.module.needs.step_pool is not None and len(micro_batches) > 1:
        phase("forward")
        with torch.no_grad():
            pool = engine(micro_batches, pool_pass=True)
    sums: dict[str, torch.Tensor] = {}
    reduction = engine.module.gradient_reduction
    if reduction is not None:
        reduction.start_step()
    for index, batch in enumerate(micro_batches):
        phase("forward")
        spans.start("forward")
        losses = engine(batch, pool, index)
        spans.stop("forward")
        total = sum(losses.values())
        if phase("backward") == "nan":  # an injected fault
            total = total * float("nan")
        last = index == len(micro_batches) - 1
        if reduction is not None:
            reduction.reducing = last
        # With a pool every micro-batch loss is the step's loss: sum gradients, don't average.
        engine.backward(total, scale_wrt_gas=pool is None)
        if reduction is not None and last:
            engine.optimizer.checked = reduction.finish()
        phase("step")
        engine.step()
        for name, value in losses.items():
            share = value.detach() / len(micro_batches)
            sums[name] = sums[name] + share if name in sums else share
    sums["total"] = sum(sums.values())
    return sums


def finish(cfg: Config, method: Method, handoff: list, run_dir: Path, step: int,
           sharded: ShardedCopies | None, metrics: MetricLogger) -> dict[str, Any]:
    """Consolidated fp32 weights, then the method's evaluation on a model loaded back from them.

    `handoff` holds the only reference to the engine: once the weights are written it is dropped, so the
    evaluation model does not sit in accelerator memory beside the training one.
    """
    engine = handoff.pop()
    checkpoint.write_weights(engine.module.model, run_dir / checkpoint.WEIGHTS, sharded)
    device = engine.device
    release(engine)
    del engine
    mdist.barrier()
    if mdist.get_rank() != 0:
        return {}
    model = checkpoint.read_weights(method.build_model(cfg, run_dir), run_dir / checkpoint.WEIGHTS).to(device).eval()
    results = method.evaluate(model, cfg, run_dir)
    with torch.no_grad():
        results.update(evaluate_sets(method, model.eval(), cfg, run_dir))
    if results:
        metrics.write_final(step, results)
        print("final evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in results.items()), flush=True)
    return results


def release(engine) -> None:
    """Free what the engine holds (DeepSpeed's buffers, the optimizer state); the caller drops the last reference."""
    engine.destroy()
    engine.optimizer = engine.lr_scheduler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

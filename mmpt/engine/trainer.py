"""The one training loop of mmpt. Methods plug in model, loss, data and evaluation; this owns the rest."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmpt import distributed as mdist
from mmpt.config import Config, save_config
from mmpt.data.loader import SkipPolicy, StatefulLoader
from mmpt.engine import checkpoint
from mmpt.engine.deepspeed_config import check_precision, deepspeed_config
from mmpt.engine.metrics import MetricLogger
from mmpt.engine.optim import build_optimizer, warmup_cosine
from mmpt.methods import Method, get_method

log = logging.getLogger(__name__)


class TrainingModule(nn.Module):
    """Model + loss as one module, so DeepSpeed's forward hooks see every parameter use."""

    def __init__(self, method: Method, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.method, self.model, self.loss = method, model, loss

    def forward(self, batch: dict[str, Any], pool: Any = None, index: int = 0) -> dict[str, torch.Tensor]:
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


def match_buffer_precision(module: nn.Module, dtype: torch.dtype) -> None:
    """ZeRO-3 casts parameters but not buffers (e.g. BatchNorm statistics); stages 0-2 cast both."""
    for buffer in module.buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.data.to(dtype)


def prepare_demo_data(cfg: Config) -> None:
    if cfg.data.prepare == "digits":
        from mmpt.data.demo_digits import build_digits

        build_digits(Path(cfg.data.root) / "digits")


def train(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to `train.max_steps` (resuming if asked); returns the final evaluation metrics."""
    import deepspeed

    check_precision(cfg)
    mdist.ensure_rendezvous_env()
    use_cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    rank, world_size = mdist.get_rank(), mdist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(mdist.process_info().local_rank)
    method = get_method(cfg.method_name)
    run_dir = Path(cfg.run.output_dir)

    if rank == 0:
        prepare_demo_data(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        method.prepare(cfg, run_dir)
    mdist.barrier()

    # Same initial weights on every rank; per-rank randomness (dropout) diverges after.
    seed_everything(cfg.train.seed)
    module = TrainingModule(method, method.build_model(cfg, run_dir), method.build_loss(cfg))
    optimizer = build_optimizer(module.model, cfg.optim)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio)
    )
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=schedule, config=deepspeed_config(cfg, world_size)
    )
    float_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.precision]
    match_buffer_precision(engine.module, float_dtype)
    seed_everything(cfg.train.seed + rank)

    train_cfg = cfg.data.train
    loader = StatefulLoader(
        method.train_data(cfg, run_dir, rank=rank, world_size=world_size),
        SkipPolicy(train_cfg.max_skip_rate, train_cfg.min_samples_for_skip_rate),
    )
    step, restored_rng = 0, None
    resume_from = checkpoint.find_resume(run_dir, cfg.run.resume)
    if resume_from is not None:
        step, rank_state = checkpoint.load(engine, resume_from)
        loader.load_state_dict(rank_state["data"])
        restored_rng = rank_state["rng"]
        if rank == 0:
            log.warning("resumed from %s at step %d", resume_from, step)
    batches = iter(loader)
    if restored_rng is not None:
        checkpoint.set_rng_state(restored_rng)  # after iter(): creating the loader iterator draws from the RNG

    global_batch = train_cfg.batch_size * cfg.train.grad_accum * world_size
    metrics = MetricLogger(run_dir, max_steps=cfg.train.max_steps, start_step=step, global_batch=global_batch,
                           tensorboard=cfg.run.tensorboard, progress_bar=cfg.run.progress_bar)
    device = engine.device
    try:
        while step < cfg.train.max_steps:
            started = time.perf_counter()
            micro_batches = [to_device(next(batches), device, float_dtype) for _ in range(cfg.train.grad_accum)]
            data_time = time.perf_counter() - started
            with torch.no_grad():
                pool = method.step_pool(engine.module.model, engine.module.loss, micro_batches)
            sums: dict[str, float] = {}
            for index, batch in enumerate(micro_batches):
                losses = engine(batch, pool, index)
                # With a pool every micro-batch loss is the step's loss: sum gradients, don't average.
                engine.backward(sum(losses.values()), scale_wrt_gas=pool is None)
                engine.step()
                for name, value in losses.items():
                    sums[name] = sums.get(name, 0.0) + value.item() / cfg.train.grad_accum
            step += 1
            sums["total"] = sum(sums.values())
            metrics.update(sums, time.perf_counter() - started, data_time)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                counts = loader.counts()
                totals = mdist.all_reduce_sum(torch.tensor(list(counts.values()), dtype=torch.float64)).tolist()
                metrics.log(step, engine.get_lr()[0], {f"data/{k}": int(v) for k, v in zip(counts, totals)})
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.max_steps:
                state = {"data": loader.state_dict(), "rng": checkpoint.rng_state()}
                checkpoint.save(engine, run_dir, step, state, cfg.train.keep_last)
    finally:
        metrics.close()

    weights = checkpoint.gathered_state_dict(engine.module.model)
    if rank == 0:
        checkpoint.save_weights(weights, run_dir / checkpoint.WEIGHTS)
    mdist.barrier()
    results: dict[str, Any] = {}
    if rank == 0:
        from mmpt.hub import load_run

        model = load_run(run_dir, device=device)[2]
        results = method.evaluate(model, cfg, run_dir)
        if results:
            MetricLogger.append_summary(run_dir, {"step": step, **results})
            print("final evaluation: " + ", ".join(f"{k}={v:.4f}" for k, v in results.items()), flush=True)
    return results


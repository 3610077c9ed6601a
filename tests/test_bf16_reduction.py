"""bf16 training on 2 gloo ranks with K=4 micro-batches: DeepSpeed's reduced, accumulated gradient is the fp32 one.

The model's gradients are its inputs (loss = sum of weight * input), bf16 numbers that bf16 holds exactly, so
each micro-batch's gradient is exact and only the sums can round: over the 4 micro-batches and over the
ranks. Summed in fp32 they are exact here (a few bf16 values add up within fp32's 24 bits); summed in bf16,
each partial sum keeps 8 bits and the gradient is off by ~1e-3 relative. The reference is the mean over ranks
and micro-batches of the inputs, in fp64.
"""

import importlib
import os

import pytest
import torch
from torch import nn

from conftest import run_on_gloo_ranks
from mmpt.config import TrainConfig
from mmpt.engine.deepspeed_config import precision, zero_optimization

RANKS, MICRO_BATCHES, TOLERANCE = 2, 4, 1e-6
SHAPES = {"vector": (64,), "matrix": (8, 16)}


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.vector = nn.Parameter(torch.ones(SHAPES["vector"]))
        self.matrix = nn.Parameter(torch.ones(SHAPES["matrix"]))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.stack([(getattr(self, name) * x.to(self.vector.dtype)).sum() for name, x in inputs.items()]).sum()


def inputs(rank: int, micro_batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * rank + micro_batch)
    return {name: torch.randn(shape, generator=gen).bfloat16() for name, shape in SHAPES.items()}


def check_summed_gradient_is_fp32(rank, stage):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS))
    backend = importlib.import_module("deepspeed.comm.torch")
    pytest.MonkeyPatch().setattr(backend, "build_shm_op", lambda: None)  # gloo only: no C++ build (spawned rank)
    deepspeed.init_distributed(dist_backend="gloo")
    train = TrainConfig(precision="bf16", zero_stage=stage, grad_accum=MICRO_BATCHES, grad_clip=0.0, max_steps=1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "train_batch_size": MICRO_BATCHES * RANKS,
        "gradient_clipping": 0.0,
        "zero_optimization": zero_optimization(train, use_cuda=False, world_size=RANKS),
        **precision(train),
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
    }
    model = Weighted()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    for micro_batch in range(MICRO_BATCHES):
        engine.backward(engine(inputs(rank, micro_batch)))
        if micro_batch < MICRO_BATCHES - 1:
            engine.step()  # DeepSpeed counts micro-batches here; it steps only at the last
    for name in SHAPES:
        got = safe_get_full_grad(getattr(model, name))
        assert got is not None, name
        expected = torch.stack([inputs(r, k)[name].double() for r in range(RANKS) for k in range(MICRO_BATCHES)])
        expected = expected.mean(0)
        error = ((got.double() - expected).norm() / expected.norm()).item()
        assert error < TOLERANCE, f"ZeRO-{stage} {name}: relative error {error:.2e} ({got.dtype})"
    engine.step()


def test_bf16_gradients_reduce_and_accumulate_in_fp32_at_zero_1_to_3():
    run_on_gloo_ranks(__name__, [("check_summed_gradient_is_fp32", (stage,)) for stage in (1, 2, 3)], RANKS)

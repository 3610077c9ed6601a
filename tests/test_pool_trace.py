"""ZeRO-3 keeps its prefetch trace through GBA-ITC's pooled accumulation (`mmpt/engine/zero3/pool_trace.py`):
after the first two steps no period invalidates the trace, where the pool pass sharing the training trace
invalidates it once every step. 2 gloo ranks, a tiny M²-Encoder, K = 2."""

import os

import torch.distributed as dist
from test_gba_itc_engine import ROWS, m2_section, make_config, split, step_batch

from conftest import run_on_gloo_ranks

WORLD, STEPS = 2, 5


def count_invalidations(rank, tmp):
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from mmpt import distributed as mdist
    from mmpt.engine.run import build_engine
    from mmpt.engine.trainer import optimizer_step
    from mmpt.methods import get_method

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    invalidated = []
    original = PartitionedParameterCoordinator._invalidate_trace

    def counting(self):
        invalidated.append(step)
        original(self)

    PartitionedParameterCoordinator._invalidate_trace = counting
    try:
        late = {}
        for own in (True, False):
            cfg = make_config(f"{tmp}/{own}", 3, 2, ROWS * 2, m2_section(1, 0))
            engine, _, _ = build_engine(cfg, get_method("m2_encoder"), mdist.ParallelLayout.whole_world(), WORLD)
            assert engine.module.pool_trace is not None
            if not own:
                engine.module.pool_trace = None
            invalidated.clear()
            for step in range(STEPS):
                optimizer_step(engine, split(step_batch(rank, step, ROWS * 4), 2))
            late[own] = [s for s in invalidated if s >= 2]
            engine.destroy()
    finally:
        PartitionedParameterCoordinator._invalidate_trace = original
    assert late[True] == [], late
    assert late[False] == [2, 3, 4], late  # the check itself sees what it is there to see
    dist.barrier()


def test_the_pool_pass_keeps_zero3s_prefetch_trace(tmp_path):
    run_on_gloo_ranks(__name__, [("count_invalidations", (str(tmp_path),))], WORLD)

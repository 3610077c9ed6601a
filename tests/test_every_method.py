"""Every registered method end to end in one process (a world of one), at the size its `tiny_overrides` give:
build, train 2 steps, checkpoint, resume for a third, write the final weights, evaluate, load the run back.

The fast tier's signal that each method still trains; the launches (config matrix, faults, multi-node) cover
ranks, ZeRO stages and precisions. A method registered later is picked up by `list_methods()`.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
from test_config_matrix import COMMON, corpora  # noqa: F401 (corpora is a fixture)

from conftest import REPO, read_metrics
from mmpt.methods import get_method, list_methods


@pytest.fixture(scope="module")
def one_process():
    """A process group of one for this module's runs (the first `train` starts it, the others reuse it), gone
    afterwards with the rendezvous variables it set, so that later tests start clean.

    A world of one never routes a collective through DeepSpeed's shared-memory all-reduce
    (`mmpt.engine.shm_collectives`), so its C++ op is not built here: uncached, that compile is a minute or
    more, longer than every method's runs together."""
    import torch.distributed as dist

    from mmpt import distributed as mdist

    saved = dict(os.environ)
    backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` as an attribute is torch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "build_shm_op", lambda: None)
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
    mdist.set_sequence_parallel(1)
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("name", list_methods())
def test_method_trains_resumes_evaluates_and_loads(name, corpora, one_process, tmp_path):  # noqa: F811
    import mmpt
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    method = get_method(name)
    config = REPO / "configs" / name / "demo.yaml"
    assert config.is_file(), f"method '{name}' ships no configs/{name}/demo.yaml"
    run_dir = tmp_path / "run"
    overrides = [
        *COMMON,
        *(o.format(**corpora) for o in method.tiny_overrides),
        f"run.output_dir={run_dir}",
        "train.save_every=2",
        "train.eval_every=2",
        "train.zero_stage=0",
        "train.precision=fp32",
    ]
    train(load_config(config, [*overrides, "train.max_steps=2"]))
    results = train(load_config(config, [*overrides, "train.max_steps=3"]))  # resumes from the step-2 checkpoint

    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "loss/total" in r] == [1, 2, 3], "the second start did not resume at 2"
    assert all(math.isfinite(r["loss/total"]) for r in records if "loss/total" in r)
    assert results and all(math.isfinite(v) for v in results.values() if isinstance(v, float)), results
    evaluated = [r["step"] for r in records if any(k.startswith("eval/") for k in r)]
    assert evaluated[0] == 2 and evaluated[-1] == 3, evaluated  # while training (eval_every) and at the end
    model = mmpt.load(run_dir)  # the final weights load strictly into a freshly built model
    assert model.config.method_name == name

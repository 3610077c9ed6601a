"""Models built partitioned under ZeRO-3 (`mmpt/engine/zero3/build.py`), on 2 gloo ranks.

- The partitioned model starts from exactly the weights one process builds with the same seed: an open_clip
  ViT whose text tower's parent initialises its children's weights (what `zero.Init` alone would lose).
- Memory, on an M²-Encoder of ~310 MB in fp32 started from its initial weights (`init_from`: an mmpt release,
  or an official checkpoint), read tensor by tensor: while the model is built and loaded, no rank's peak
  resident memory grows by 0.8x the whole model's fp32 bytes (its half, one module whole at a time, the
  file's pages being read: 0.63-0.72x measured), where building it whole grows it by more than the whole;
  writing the final weights grows no rank by more than a fifth. The weights each rank ends with are the
  file's, as one process loads them.
- Weights that do not fit, found on rank 0 (by the method's loader or by the check of the file's tensors),
  stop every rank with the same error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, run_on_gloo_ranks

WORLD = 2
ARCH = {  # ~80M parameters, no single tensor above 5% of them: partitions, not one module, decide the peak
    "vocab_size": 1000,
    "width": 512,
    "heads": 8,
    "lower_layers": 10,
    "shared_layers": 2,
    "output_dim": 256,
    "image_size": 32,
    "patch_size": 16,
    "text_positions": 64,
    "context_length": 16,
    "position_init_std": 0.02,
}


def _config(method: dict, run_dir: str):
    from mmpt.config_loader import validate_config

    return validate_config(
        {
            "method": method,
            "data": {"train": {"sources": [{"shards": "unused.tar"}], "batch_size": 2}},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "train": {"max_steps": 1, "zero_stage": 3, "grad_clip": 1.0},
            "run": {"output_dir": run_dir, "progress_bar": False, "tensorboard": False},
        }
    )


def _start(rank: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))


def _peak_growth(work):
    """(what `work()` returned, how far this process's peak resident memory rose above its resident memory
    before it, in bytes). Linux: writing 5 to clear_refs resets the peak (VmHWM) to the current size."""
    from mmpt.engine.zero3.build import release_freed_memory

    release_freed_memory()  # what earlier work freed would otherwise hide what `work` allocates
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    result = work()
    return result, _status_bytes("VmHWM") - before


def _deepspeed_ready() -> None:
    """What the build imports (DeepSpeed's partitioning, transformers' modelling code and init switch) imported
    first: import memory is not the model's (`import mmpt` imports none of it)."""
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters  # noqa: F401
    from transformers import BertModel  # noqa: F401  (transformers' modelling code: accelerate, scipy, ...)
    from transformers.initialization import no_init_weights  # noqa: F401

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def check_the_partitioned_model_starts_where_one_process_does(rank, tmp):
    _start(rank)
    from mmpt import distributed as mdist
    from mmpt.engine.checkpoint import gathered_state_dict
    from mmpt.engine.optim import param_groups
    from mmpt.engine.run import build_engine, seed_everything
    from mmpt.methods import get_method

    method = get_method("open_clip")
    model = str(REPO / "mmpt/models/bench-vit-tiny.json")
    cfg = _config({"name": "open_clip", "model": model}, f"{tmp}/run")
    engine, _, _ = build_engine(cfg, method, mdist.ParallelLayout.whole_world(), WORLD)
    assert all(hasattr(p, "ds_id") for p in engine.module.parameters())  # partitioned
    weights = gathered_state_dict(engine.module.model)
    if rank == 0:
        seed_everything(cfg.train.seed)
        plain = method.build_model(cfg, Path(tmp))
        reference = plain.state_dict()
        # Weight decay falls on the same parameters, though a partition is flat.
        groups = [len(g["params"]) for g in param_groups(engine.module.model, 0.1, [])]
        assert groups == [len(g["params"]) for g in param_groups(plain, 0.1, [])] and len(groups) == 2
        assert weights is not None and weights.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor.float()), name
        text = reference["clip.token_embedding.weight"]  # open_clip's text init_parameters: std 0.02
        assert abs(text.std().item() - 0.02) < 0.002
    engine.destroy()
    dist.barrier()


def check_memory_while_building_loading_and_writing(rank, tmp, kind):
    _start(rank)
    from safetensors.torch import load_file

    from mmpt import distributed as mdist
    from mmpt.engine.checkpoint.weights import gathered_state_dict, write_weights
    from mmpt.engine.deepspeed_config import deepspeed_config
    from mmpt.engine.run import seed_everything
    from mmpt.engine.zero3.build import build_partitioned
    from mmpt.methods import get_method
    from mmpt.methods.m2_encoder import official_state

    method = get_method("m2_encoder")
    release = Path(tmp) / "release"
    settings = {"name": "m2_encoder", "model": "m2-encoder-demo", "arch": ARCH, "tokenizer": "unused.json"}
    official = Path(tmp) / "official" / "m2_encoder_demo.ckpt"
    if rank == 0:  # weights to start from: a model of the same architecture, other weights
        seed_everything(123)
        release.mkdir()
        started = method.build_model(_config(settings, tmp), release)
        write_weights(started, release / "model.safetensors")
        if kind == "official":  # the official layout (0-D scales, a Lightning checkpoint), written independently
            official.parent.mkdir()
            torch.save({"state_dict": official_state(started.state_dict(), _config(settings, tmp))}, official)
        del started
    dist.barrier()
    cfg = _config({**settings, "init_from": str(release if kind == "release" else official.parent)}, f"{tmp}/run")
    expected = load_file(str(release / "model.safetensors"))
    whole_bytes = sum(t.numel() * 4 for t in expected.values())
    assert whole_bytes > 250e6
    del expected

    def build():
        seed_everything(cfg.train.seed)
        return method.build_model(cfg, Path(tmp))

    if rank == 1:  # what every rank paid before: the whole model, built and loaded
        _, plain = _peak_growth(lambda: method.load_initial_weights(build(), cfg))
        assert plain > whole_bytes, (plain, whole_bytes)
    ds_config = deepspeed_config(cfg, WORLD)
    _deepspeed_ready()  # its imports and process group are not the model's memory
    (model, said, _), grown = _peak_growth(
        lambda: build_partitioned(
            build, lambda m: method.load_initial_weights(m, cfg), method.initial_tensors(cfg), lambda m: (), ds_config
        )
    )
    # Judged on every rank from every rank's figure: a rank that failed alone would leave the other waiting.
    growth = mdist.all_gather_objects(grown)
    assert all(g < 0.8 * whole_bytes for g in growth), f"built and loaded with {growth} of {whole_bytes} bytes"
    assert said is not None and cfg.method.init_from in said and "strict" in said  # rank 0's words, on every rank

    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    path = Path(tmp) / "final" / "model.safetensors"
    path.parent.mkdir(exist_ok=True)
    _, written = _peak_growth(lambda: write_weights(engine.module, path))
    growth = mdist.all_gather_objects(written)
    assert all(g < 0.2 * whole_bytes for g in growth), f"wrote the weights with {growth} bytes"
    loaded = gathered_state_dict(engine.module)
    if rank == 0:  # as one process loads them
        reference = method.build_model(cfg, Path(tmp))
        method.load_initial_weights(reference, cfg)
        expected = reference.state_dict()
        assert loaded is not None and loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        assert all(torch.equal(v, expected[k]) for k, v in load_file(str(path)).items())
    mdist.barrier()


def test_the_partitioned_model_starts_from_the_weights_one_process_builds(tmp_path):
    run_on_gloo_ranks(
        __name__, [("check_the_partitioned_model_starts_where_one_process_does", (str(tmp_path),))], WORLD
    )


@pytest.mark.parametrize("kind", ["release", "official"])
def test_no_rank_holds_the_whole_model_while_building_loading_and_writing(tmp_path, kind):
    run_on_gloo_ranks(__name__, [("check_memory_while_building_loading_and_writing", (str(tmp_path), kind))], WORLD)


def check_rank_0s_loading_error_is_raised_on_every_rank(rank, tmp, found_by):
    _start(rank)
    from mmpt.engine.checkpoint.weights import write_weights
    from mmpt.engine.deepspeed_config import deepspeed_config
    from mmpt.engine.zero3.build import build_partitioned
    from mmpt.methods import get_method
    from mmpt.models.tensor_files import CheckpointMismatch

    method = get_method("m2_encoder")
    small = {**ARCH, "width": 32, "heads": 2, "lower_layers": 1, "shared_layers": 1}
    settings = {"name": "m2_encoder", "model": "m2-encoder-demo", "arch": small, "tokenizer": "u.json"}
    release = Path(tmp) / "wider"
    if rank == 0:  # weights of another width
        release.mkdir()
        write_weights(
            method.build_model(_config({**settings, "arch": {**small, "width": 64}}, tmp), release),
            release / "model.safetensors",
        )
    dist.barrier()
    cfg = _config({**settings, "init_from": str(release)}, tmp)

    def load(model):
        raise CheckpointMismatch("release/model.safetensors does not fit this M2-Encoder config: missing [...]")

    tensors = method.initial_tensors(cfg) if found_by == "reading the file" else None
    try:
        build_partitioned(
            lambda: method.build_model(cfg, Path(tmp)), load, tensors, lambda m: (), deepspeed_config(cfg, WORLD)
        )
    except CheckpointMismatch as exc:  # the config error's exit code, on every rank, and nobody left waiting
        assert "does not fit" in str(exc)
        if found_by == "reading the file":
            assert str(release) in str(exc) and "shape mismatch" in str(exc)
    else:
        raise AssertionError("no error")


@pytest.mark.parametrize("found_by", ["the method's loader", "reading the file"])
def test_an_error_loading_on_rank_0_stops_every_rank_with_it(tmp_path, found_by):
    run_on_gloo_ranks(
        __name__, [("check_rank_0s_loading_error_is_raised_on_every_rank", (str(tmp_path), found_by))], WORLD
    )

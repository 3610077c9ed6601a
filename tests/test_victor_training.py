"""The VICTOR demo config end to end, shortened, on 2 CPU ranks: every task logged, the key network
updated under ZeRO-3, retrieval evaluated (jsonl and MSR-VTT csv) by the CLI as at the end of training,
and a resumed run restoring the memory queues exactly."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, read_metrics, run_tool, train_in_process
from pool import scenario

pytestmark = pytest.mark.distributed

TASKS = ("mlm", "msom", "mfom", "intra_mfm", "inter_mfm", "dual_vsa")
SHORT = [
    "run.progress_bar=false",
    "data.train.batch_size=8",
    "train.log_every=1",
    "method.queue_size=24",
    "method.frame_queue_size=100",
    "data.train.shuffle_buffer=50",
]


def zeroshot_cli(cwd, run, dataset, language, out):
    args = ["--model", str(run), "--dataset", dataset, "--task", "zeroshot_retrieval", "--language", language]
    run_tool("zeroshot", *args, "--output", str(out), cwd=cwd, timeout=300)
    return json.loads(out.read_text())


MOMENTUM = 0.75
ZERO3 = [
    "train.max_steps=4",
    "train.save_every=1",
    "train.keep_last=4",
    "train.zero_stage=3",
    f"method.momentum={MOMENTUM}",
    "optim.min_lr_ratio=1.0",  # a constant rate after warm-up: a start stopped at step 2 is a killed one
]


def victor_scenario(name: str, kind: str) -> str:
    """4 steps of the demo config under ZeRO-3, a checkpoint after every step, in the shared pool (whose folder
    the demo's relative paths point into). Momentum 0.75: after each step the key network must be the EMA of its
    previous value and the query towers just updated, which needs the engine to gather ZeRO-3's partitioned
    parameters for the update."""

    @scenario(name)
    def build(corpora, run_dir):
        return REPO / "configs/victor/demo.yaml", [*SHORT, *ZERO3], kind

    return name


WHOLE = victor_scenario("victor-demo-zero3", "train")
RESUMED = victor_scenario("victor-demo-zero3-resumed", "stop_at:2")  # stopped after step 2, then resumed


@pytest.mark.pool(WHOLE)
def test_victor_demo_trains_under_zero3_and_evaluates_retrieval(rank_pool, tmp_path):
    run = rank_pool.run_dir(WHOLE)
    cwd = run.parent  # where the demo's relative paths point
    records = [r for r in read_metrics(run) if "loss/total" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for task in TASKS:
        values = [r[f"loss/{task}"] for r in records]
        assert all(math.isfinite(v) for v in values), task
        assert task in ("dual_vsa", "inter_mfm") or min(values) > 0, task
    # the queues are empty at step 1 (its loss has no negatives); from step 2 on they hold step 1's keys
    assert records[0]["loss/dual_vsa"] == pytest.approx(0.0, abs=1e-6) and records[1]["loss/dual_vsa"] > 0
    assert records[-1]["data/seen"] == 4 * 8 * 2 and records[-1]["data/skipped"] == 0

    # key_s = m * key_(s-1) + (1 - m) * query_s for every weight, the query towers' parameters whole (consolidated
    # from the ZeRO-3 shards). Batch-norm statistics are left out: the key network's own forward moves them too.
    # At step 1 the previous key network is the initial query towers: the run's model built again from its seed.
    key = initial_towers(cwd, run)
    for step in (1, 2, 3, 4):
        query, previous, key = query_parameters(run, step), key, key_network(run, step)
        assert query.keys() <= key.keys() and len(query) > 20
        moved = 0
        for name in query:
            value = key[name]
            expected = MOMENTUM * previous[name].double() + (1 - MOMENTUM) * query[name].double()
            torch.testing.assert_close(
                value.double(), expected, rtol=0, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}"
            )
            moved += not torch.equal(value, previous[name])
        assert moved > len(query) // 2  # the key network really moves
    weights = load_file(run / "model.safetensors")
    assert all(torch.equal(weights[f"key.network.{name}"], value) for name, value in key.items())
    # each rank holds about half of the key network (its partitions, plus the whole batch-norm statistics)
    whole_mib = sum(v.numel() * 4 for k, v in weights.items() if k.startswith("key.network.")) / 2**20
    per_rank = records[-1]["momentum_copy_mib_per_rank"]
    assert len(per_rank) == 2 and all(whole_mib / 2 <= m < 0.55 * whole_mib for m in per_rank), (per_rank, whole_mib)

    final = read_metrics(run)[-1]
    for language in ("en", "zh"):
        for key in ("video_retrieval_recall@1", "text_retrieval_recall@10", "video_retrieval_median_rank"):
            assert f"eval/moving_digits/{language}/{key}" in final
        record = zeroshot_cli(cwd, run, "moving_digits", language, tmp_path / f"{language}.json")
        for key, value in record["metrics"].items():
            # The end-of-training evaluation ran inside a DeepSpeed rank, this one in a fresh process: last-bit
            # differences can swap a pair of near-tied scores of a 4-step model, moving a rank by one.
            if f"eval/moving_digits/{language}/{key}" in final:
                assert value == pytest.approx(final[f"eval/moving_digits/{language}/{key}"], abs=0.01, rel=0.01), key
    # the MSR-VTT-style csv (first caption of each clip) over the same clips
    csv_record = zeroshot_cli(cwd, run, "demo_data/moving_digits/test/msrvtt_en.csv", "en", tmp_path / "csv.json")
    clips = len((cwd / "demo_data/moving_digits/test/msrvtt_en.csv").read_text().splitlines()) - 1
    assert 1 <= csv_record["metrics"]["video_retrieval_median_rank"] <= clips


def model_states(run: Path, step: int, rank: int = 0) -> dict:
    """What a rank saved besides optimizer state: "module" (parameter placeholders under ZeRO-3, buffers whole),
    "buffer_names", ..."""
    path = run / "checkpoints" / f"step_{step:09d}" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_module(run: Path, step: int, rank: int = 0) -> dict:
    return model_states(run, step, rank)["module"]


def key_network(run: Path, step: int, ranks: int = 2) -> dict:
    """The momentum copy's weights saved at `step`, whole. Under ZeRO-3 each rank saved its own flat partition of
    every tensor that follows a parameter (ZeRO's layout: ceil(numel / ranks) elements per rank, zero-padded at
    the end); those are put back together here, shaped as in the consolidated weights. Tensors following buffers
    (batch-norm statistics) are saved whole by every rank."""
    prefix = "model.key.network."
    shapes = {
        k[len("key.network.") :]: v.shape
        for k, v in load_file(run / "model.safetensors").items()
        if k.startswith("key.network.")
    }
    parts = [
        {k[len(prefix) :]: v for k, v in checkpoint_module(run, step, r).items() if k.startswith(prefix)}
        for r in range(ranks)
    ]
    whole = {}
    for name, shape in shapes.items():
        if parts[0][name].shape == shape:
            whole[name] = parts[0][name]
            continue
        size = -(-shape.numel() // ranks)
        assert all(p[name].shape == (size,) for p in parts), name
        whole[name] = torch.cat([p[name] for p in parts])[: shape.numel()].view(shape)
    return whole


def initial_towers(cwd: Path, run: Path) -> dict:
    """The query towers' weights before step 1, as the engine built them (seeded with `train.seed`)."""
    import os

    from mmpt.config_loader import load_config
    from mmpt.engine.run import seed_everything
    from mmpt.methods.victor import METHOD

    here = os.getcwd()
    os.chdir(cwd)  # the config's paths are relative to where training ran
    try:
        cfg = load_config(run / "config.yaml")
        seed_everything(cfg.train.seed)
        return {k: v.detach().clone() for k, v in METHOD.build_model(cfg, run).unimodal.state_dict().items()}
    finally:
        os.chdir(here)


def query_parameters(run: Path, step: int) -> dict:
    """The query towers' parameters at `step`, consolidated from every rank's ZeRO-3 partition."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    prefix = "model.unimodal."
    buffers = set(model_states(run, step)["buffer_names"])
    state = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=f"step_{step:09d}")
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and k not in buffers}


def killed_after_step_2(run: Path, target: Path) -> Path:
    """A copy of the ZeRO-3 run as if killed after step 2 (only its step-2 checkpoint survives), at
    `target`/runs/victor-demo, with the demo's data beside it."""
    target.mkdir()
    (target / "demo_data").symlink_to(run.parent / "demo_data")
    shutil.copytree(
        run,
        target / "runs/victor-demo",
        ignore=shutil.ignore_patterns("step_000000003", "step_000000004", "model.safetensors", "eval", "metrics.jsonl"),
    )
    (target / "runs/victor-demo/checkpoints/latest").write_text("step_000000002")
    return target


@pytest.mark.pool(WHOLE, RESUMED)
def test_resumed_run_restores_the_memory_queues(rank_pool):
    run, resumed = rank_pool.run_dir(WHOLE), rank_pool.run_dir(RESUMED)
    assert any(line.startswith("resumed from") for line in rank_pool.record(RESUMED)["said"])
    uninterrupted = checkpoint_module(run, 4)
    again = checkpoint_module(resumed, 4)
    queues = [k for k in uninterrupted if "_queue." in k]
    assert {k.split(".")[1] for k in queues} == {"video_queue", "text_queue", "frame_queue"}
    assert int(uninterrupted["loss.video_queue.count"]) == 24  # 4 pushes of 2 ranks x 8 keys, capped at 24
    other_rank = checkpoint_module(run, 4, rank=1)
    for name in queues:
        assert torch.equal(uninterrupted[name], again[name]), name
        assert torch.equal(uninterrupted[name], other_rank[name]), name  # the same queue on every rank
    for rank in (0, 1):  # under ZeRO-3 each rank saved its own partition of the key network
        uninterrupted, again = checkpoint_module(run, 4, rank), checkpoint_module(resumed, 4, rank)
        keys = [k for k in uninterrupted if k.startswith("model.key.")]
        assert len(keys) > 20
        for name in keys:
            assert torch.equal(uninterrupted[name], again[name]), (rank, name)


@pytest.mark.pool(WHOLE)
def test_key_network_resumes_on_another_number_of_ranks(rank_pool, tmp_path, process_group_of_one, monkeypatch, caplog):
    """The 2-rank ZeRO-3 checkpoint of step 2 loaded by one rank (in this process): its key network, rebuilt from
    both ranks' partitions, is written whole into the consolidated weights, equal to what the two ranks saved."""
    from mmpt.config_loader import load_config

    run = rank_pool.run_dir(WHOLE)
    elastic = killed_after_step_2(run, tmp_path / "elastic")
    monkeypatch.chdir(elastic)  # the demo's relative paths
    with caplog.at_level("WARNING", logger="mmpt"):
        train_in_process(load_config(REPO / "configs/victor/demo.yaml", [*SHORT, *ZERO3[1:], "train.max_steps=2"]))
    assert "saved by 2 ranks" in caplog.text
    saved = key_network(run, 2)
    weights = load_file(elastic / "runs/victor-demo/model.safetensors")
    assert len(saved) > 20
    for name, value in saved.items():
        assert torch.equal(weights[f"key.network.{name}"], value), name

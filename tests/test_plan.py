"""The planner: counts from the meta-device build equal a real build's, model states equal the bytes two gloo
ranks of a DeepSpeed engine actually hold at ZeRO 0-3 in fp32 and bf16 (and DeepSpeed's own estimators), the
command's JSON and its one-line refusal."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import command_in_process, run_on_gloo_ranks
from mmpt.config_loader import load_config
from mmpt.methods import get_method
from mmpt.plan.build import Counts, built, count
from mmpt.plan.states import Layout, model_states

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs/m2_encoder/demo.yaml")


def test_meta_build_counts_equal_a_real_build(tmp_path):
    cfg = load_config(DEMO)
    with built(cfg) as b:
        counts = count(b)
        assert next(b.model.parameters()).is_meta
    method = get_method(cfg.method_name)
    method.prepare(cfg, tmp_path)
    real = method.build_model(cfg, tmp_path)
    assert counts.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert counts.frozen == 0


def test_momentum_copies_and_queues_are_counted(tmp_path):
    cfg = load_config(
        ROOT / "configs/victor/demo.yaml",
        [f"method.tokenizer={ROOT}/demo_data/digits/tokenizer.json", "method.text.vocab_size=300"],
    )
    with built(cfg) as b:
        counts = count(b)
        key: torch.nn.Module = b.needs.momentum_copies[0]  # the method's declared momentum copy
        assert counts.momentum == sum(t.numel() for t in key.buffers() if t.is_floating_point())
        assert counts.loss_buffers >= 2 * 512 * 64 + 2048 * 96  # the two queues of embed_dim, the frame queue


def deepspeed_estimates():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_model_states_match_deepspeeds_estimators(nodes):
    zero2, zero3 = deepspeed_estimates()
    counts = Counts(
        trainable=10_182_004_738, frozen=0, largest_layer=472_039_424, momentum=0, buffers=0, loss_buffers=0
    )
    world = 8 * nodes
    s2 = model_states(counts, Layout(world=world, precision="bf16", stage=2))
    # The estimator also counts a 16-bit gradient partition, which fp32 accumulation (the engine's) never keeps.
    estimated = zero2(counts.trainable, 8, nodes, cpu_offload=False)[1] - 2 * counts.trainable // world
    assert s2.deepspeed_parts == pytest.approx(estimated, abs=world)
    s3 = model_states(counts, Layout(world=world, precision="bf16", stage=3))
    assert s3.deepspeed_parts == pytest.approx(
        zero3(counts.trainable, counts.largest_layer, 8, nodes, cpu_offload=False)[1], abs=world
    )
    offloaded = model_states(counts, Layout(world=world, precision="bf16", stage=3, offload=True))
    cpu, gpu, _ = zero3(counts.trainable, counts.largest_layer, 8, nodes, cpu_offload=True, cpu_offload_params=False)
    assert offloaded.deepspeed_parts == pytest.approx(gpu, abs=world)
    assert offloaded.host * 8 * 1.5 == pytest.approx(cpu, rel=1e-6)  # per node, with DeepSpeed's buffer factor


def test_stages_partition_what_they_say():
    counts = Counts(trainable=1000, frozen=0, largest_layer=100, momentum=50, buffers=0, loss_buffers=0)
    by_stage = [model_states(counts, Layout(world=4, precision="bf16", stage=s)) for s in range(4)]
    # bf16 at ZeRO-0 is autocast over fp32 states: 4-byte weights, moments only; ZeRO 1-3 keep 2-byte weights and
    # fp32 master weights beside the moments (12 bytes), partitioned.
    assert [s.optimizer for s in by_stage] == [8000, 3000, 3000, 3000]
    assert [s.parameters for s in by_stage] == [4000, 2000, 2000, 500]
    assert [s.gradients for s in by_stage] == [4000, 6000, 1000, 1000]
    assert by_stage[3].momentum == 50  # fp32 copies sharded like the parameters under ZeRO-3
    assert by_stage[2].momentum == 200
    hpz = model_states(counts, Layout(world=4, precision="bf16", stage=3, hpz=2))
    assert hpz.hpz_shard == 1000


def check_planned_states_are_held(rank, tokenizer):
    """On each of 2 gloo ranks: an engine per ZeRO stage and precision, built as training builds it; the bytes
    the rank holds at its peak (`mmpt.plan.held`) are what `states` predicts, within 5%."""
    import deepspeed

    from mmpt.plan.held import held_and_planned

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    backend = importlib.import_module("deepspeed.comm.torch")
    pytest.MonkeyPatch().setattr(backend, "build_shm_op", lambda: None)  # gloo only: no C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    misses = []
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            held, predicted = held_and_planned(DEMO, tokenizer, stage, precision)
            if abs(predicted / held.total - 1) > 0.05:
                misses.append(f"ZeRO-{stage} {precision}: predicted {predicted}, held {held}")
    assert not misses, "; ".join(misses)


def test_planned_model_states_are_what_deepspeed_ranks_hold(digits_root):
    run_on_gloo_ranks(__name__, [("check_planned_states_are_held", (str(digits_root / "tokenizer.json"),))], 2)


def run_plan(capfd, *args: str) -> subprocess.CompletedProcess:
    return command_in_process(capfd, "plan", "--config", DEMO, *args)


def test_json_plan_has_every_part(capfd):
    done = run_plan(capfd, "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    parts = plan["gpu_bytes_per_rank"]
    for key in ("parameters", "gradients", "optimizer", "momentum", "activations", "contrastive_logits", "total"):
        assert key in parts
    assert plan["cluster"]["nodes"] == 2
    assert plan["parameters"]["trainable"] > 0
    assert plan["largest_micro_batch"] >= plan["micro_batch"] and plan["fits"]
    assert plan["flops_per_sample"] > 0 and plan["samples_per_s"] > 0
    assert plan["step_s_error"].startswith("calibrated on one H100")  # at the default MFU
    assert parts["total"] == sum(
        parts[k]
        for k in parts
        if k not in ("total", "host", "gradient_checkpointing", "activations_with_checkpointing_toggled")
    )


def test_adaptive_batches_are_planned_at_the_largest_share(capfd):
    """Memory for the largest micro-batch a rank may get; throughput at the equal share it averages."""
    plans = []
    for adaptive in ("false", "true"):
        done = run_plan(
            capfd, "--gpus", "8", "--json", f"train.adaptive_batch={adaptive}", "train.adaptive_batch_max_share=2"
        )
        assert done.returncode == 0, done.stderr
        plans.append(json.loads(done.stdout))
    fixed, adaptive = plans
    assert adaptive["micro_batch"] == 2 * fixed["micro_batch"]
    assert adaptive["gpu_bytes_per_rank"]["activations"] > fixed["gpu_bytes_per_rank"]["activations"]
    assert adaptive["samples_per_s"] == fixed["samples_per_s"]


def test_no_room_for_one_sample_is_one_line_and_exit_2(capfd):
    done = run_plan(capfd, "--gpus", "2", "--gpu-memory", "0.001")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("mmpt:")]
    assert len(lines) == 1 and "does not fit" in lines[0] and "micro-batch 1" in lines[0]
    assert "Traceback" not in done.stderr and "raise train.zero_stage" in lines[0]
    done = run_plan(capfd, "--gpus", "2", "--gpu-memory", "0.001", "train.zero_stage=3")
    assert "add GPUs" in done.stderr and "raise train.zero_stage" not in done.stderr  # ZeRO-3 is the highest


def test_the_usable_share_of_gpu_memory_is_an_option(capfd):
    done = run_plan(capfd, "--gpus", "2", "--gpu-memory", "80", "--usable-share", "0.5", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["assumptions"]["usable_share"] == 0.5
    done = run_plan(capfd, "--gpus", "2", "--usable-share", "1.5")
    assert done.returncode == 2 and "--usable-share 1.5 must be in (0, 1]" in done.stderr


def test_live_bytes_follow_frees():
    from mmpt.plan.measure import LiveBytes

    x = torch.ones(1000)
    with LiveBytes([x]) as tracker:
        a = x * 2
        b = a + 1
        del a
        assert tracker.live == 4000
    assert tracker.peak == 8000
    del b


def test_a_tensor_kept_only_by_a_cycle_is_not_counted_alive():
    import gc

    from mmpt.plan.measure import LiveBytes

    class Holder:
        pass

    x = torch.ones(1000)
    gc.disable()  # Python collects only when told: what the tracker counts must not depend on when that is
    try:
        with LiveBytes([x]) as tracker:
            for _ in range(3):
                holder = Holder()
                holder.me, holder.tensor = holder, x * 2  # a cycle: refcounts alone never free it
                del holder
        assert tracker.peak == 4000  # each cycle's tensor is garbage before the next one is made
    finally:
        gc.enable()


def test_the_checkpointed_step_measures_the_same_whenever_python_collects():
    """Gradient checkpointing on fake tensors leaves its tensors in reference cycles: the measured peak once
    depended on when Python happened to collect them (8.4 to 16.6 GB for one M²-Encoder 1B step)."""
    import gc

    from mmpt.plan.measure import measure_step, on_fake_tensors, set_checkpointing

    cfg = load_config(DEMO)
    peaks = []
    for collecting in (True, False):
        with built(cfg) as b:
            mode = on_fake_tensors(b)
            assert set_checkpointing(b.model, True)
            (gc.enable if collecting else gc.disable)()
            try:
                with mode:
                    peaks.append(measure_step(b, 8).peak_bytes)
            finally:
                gc.enable()
    assert abs(peaks[0] - peaks[1]) <= 1e-4 * peaks[0], peaks  # a few bytes: when a scalar's cycle goes


def test_planning_page_is_fresh():
    from mmpt.plan.docs_table import PAGE, fingerprint

    assert f"fingerprint `{fingerprint()}`" in PAGE.read_text(), (
        "docs/planning.md is stale: python -m mmpt.plan.docs_table"
    )


def test_rank_0_holds_a_whole_copy_while_building_only_without_weights_covering_the_model(capfd):
    """ZeRO-3 on several ranks: rank 0 builds the model whole to start from, unless `init_from` gives every
    tensor (read tensor by tensor); other ranks never hold it whole. Without ZeRO-3 every rank builds it."""
    held = {}
    for name, extra in (("random", []), ("init_from", ["method.init_from=/nowhere/m2_encoder.ckpt"])):
        for stage in ("2", "3"):
            done = run_plan(capfd, "--gpus", "8", "--json", f"train.zero_stage={stage}", *extra)
            assert done.returncode == 0, done.stderr
            host = json.loads(done.stdout)["host_bytes_while_building"]
            held[name, stage] = (host["rank 0"], host["other ranks"])
    whole = held["random", "2"][0]
    assert whole > 0 and held["random", "2"] == held["init_from", "2"] == (whole, whole)
    assert held["random", "3"] == (whole, 0) and held["init_from", "3"] == (0, 0)


@pytest.mark.parametrize(
    ("config", "key", "path"),
    [
        ("configs/victor/base.yaml", "method.tokenizer", "/data/tokenizers/bert-base-chinese/tokenizer.json"),
        ("configs/space2/base.yaml", "method.encoder", "checkpoints/bert-base-uncased"),
    ],
)
def test_a_config_whose_architecture_is_in_a_missing_file_ends_in_one_line_naming_it(config, key, path, capfd):
    """VICTOR's vocabulary comes from its tokenizer file, SPACE-2's encoder from a checkpoint's config.json: not
    there, the plan names the file and its config key (not the tokenizer's os error or the hub's repo-id error)."""
    from mmpt import cli
    from mmpt.commands import plan

    assert not Path(path).exists()
    assert cli.run(plan.main, ["--config", str(ROOT / config), "--gpus", "8"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"config key '{key}': {path}" in lines[0], lines
    assert "os error" not in lines[0] and "Repo id" not in lines[0]


def test_the_step_time_is_labelled_with_its_error_measured_on_one_h100():
    """The label is what benchmarks/results/gpu/planner.json says at the assumed MFU: the steps it planned at 40%
    rescaled (one GPU: the step is compute alone, in proportion to 1 / MFU), SPACE-2's bound left out."""
    from mmpt.plan.hardware import CALIBRATED_MFU, STEP_ERROR, Assumptions, step_calibration

    rows = json.loads((ROOT / "benchmarks/results/gpu/planner.json").read_text())["rows"]
    errors = [(1 + r["step_error"]) * 0.40 / CALIBRATED_MFU - 1 for r in rows if not r["run"].startswith("SPACE-2")]
    assert len(errors) == 4
    assert f"{100 * min(errors):+.0f}% to {100 * max(errors):+.0f}%" == STEP_ERROR
    assert Assumptions().mfu == CALIBRATED_MFU
    assert step_calibration(CALIBRATED_MFU) == f"calibrated on one H100, benchmarks/results/gpu: {STEP_ERROR}"
    assert step_calibration(0.3).startswith("MFU 30% not calibrated")


def test_the_step_time_meets_the_peak_of_the_runs_precision(capfd):
    """One GPU: the step is compute alone, at bf16's peak, TF32's (half of it) for fp32 with train.tf32, plain
    fp32's without."""
    from mmpt.plan.hardware import GPUS

    steps = {}
    for precision, tf32 in (("bf16", "true"), ("fp32", "true"), ("fp32", "false")):
        done = run_plan(capfd, "--gpus", "1", "--json", f"train.precision={precision}", f"train.tf32={tf32}")
        assert done.returncode == 0, done.stderr
        plan = json.loads(done.stdout)
        assert plan["bytes_sent_per_step"] == {"zero": 0, "features": 0}
        steps[precision, tf32] = plan["step_s"]
    h100 = GPUS["h100"]
    assert steps["fp32", "true"] == pytest.approx(2 * steps["bf16", "true"])
    assert steps["fp32", "false"] == pytest.approx(steps["bf16", "true"] * h100.bf16_tflops / h100.fp32_tflops)

"""The trainer's own FLOPs and MFU (`mmpt.engine.flops`): the step counted once on fake tensors, checked against
a hand count; each logging window's perf/tflops and perf/mfu from that count, its samples and its wall time;
nothing claimed on CPU unless a peak is configured."""

import json
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from conftest import read_metrics, small_clip_demo, train_in_process


class TwoLinears:
    """A method whose step is x -> Linear(a, b) -> Linear(b, c) -> sum, on a batch of `x` only."""

    def __init__(self, a: int, b: int, c: int):
        self.sizes = (a, b, c)

    def build_model(self, cfg, run_dir) -> nn.Module:
        a, b, c = self.sizes
        return nn.Sequential(nn.Linear(a, b, bias=False), nn.Linear(b, c, bias=False))

    def build_loss(self, cfg) -> nn.Module:
        return nn.Identity()

    def engine_needs(self, model, cfg):
        from mmpt.methods import EngineNeeds

        return EngineNeeds()

    def training_step(self, model, loss, batch, pool=None, index=0) -> dict[str, torch.Tensor]:
        return {"sum": model(batch["x"]).sum()}


def test_the_counted_step_matches_a_hand_count_of_its_matmuls(tmp_path):
    from mmpt.engine.flops import step_flops

    a, b, c, batch = 24, 40, 8, 6
    cfg = SimpleNamespace(train=SimpleNamespace(precision="fp32", zero_stage=0, grad_accum=1, pool_pass="auto"))
    real = {"x": torch.randn(batch, a)}
    counted = step_flops(cast(Any, TwoLinears(a, b, c)), cast(Any, cfg), tmp_path, real)
    forward = 2 * batch * (a * b + b * c)  # a matmul of [m, k] x [k, n] is 2mkn FLOPs
    # Backward: each layer's weight gradient (a forward's worth), and the input gradient of every layer but the
    # first (its input, the batch, needs none): the "3x forward" less the first layer's input gradient.
    backward = 2 * batch * (a * b + b * c) + 2 * batch * b * c
    assert counted == forward + backward
    assert torch.equal(real["x"], real["x"]) and not real["x"].is_meta  # the batch was not replaced


class PooledTwoLinears(TwoLinears):
    """The same step with a step pool: a forward pass without gradient over each micro-batch first."""

    def engine_needs(self, model, cfg):
        from mmpt.methods import EngineNeeds

        return EngineNeeds(pool_features=lambda model, batch: model(batch["x"]), step_pool=lambda loss, features: None)


def test_the_pool_pass_is_counted_where_the_engine_runs_it(tmp_path):
    from mmpt.engine.flops import step_flops

    a, b, c, batch = 24, 40, 8, 6

    def counted(accum):
        cfg = SimpleNamespace(train=SimpleNamespace(precision="fp32", zero_stage=0, grad_accum=accum, pool_pass="auto"))
        return step_flops(cast(Any, PooledTwoLinears(a, b, c)), cast(Any, cfg), tmp_path, {"x": torch.ones(batch, a)})

    # One micro-batch a step: no pool pass. Several: one more forward per micro-batch.
    assert counted(2) - counted(1) == 2 * batch * (a * b + b * c)


def test_a_merged_pool_pass_saves_the_pool_forward_four_fifths_of_the_step_with_checkpointing():
    """GBA-ITC's step over K micro-batches with checkpointed towers, counted op by op: separate, a forward without
    gradient of each (the pool pass), then each micro-batch's forward, backward and recompute (5 forwards' worth);
    merged, each micro-batch's forward with gradient and one backward (4). What merging saves is the pool pass,
    and the separate path's K - 1 extra loss passes (here 0.3% of it)."""
    from losses.grouped_itc import GroupedContrastiveLoss
    from mmpt.engine.run import TrainingModule
    from mmpt.methods import get_method
    from mmpt.methods.base import loss_terms
    from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig

    torch.manual_seed(0)
    arch = {**PRESETS["m2-encoder-demo"], "vocab_size": 50, "grad_checkpointing": True}
    model = M2Encoder(M2EncoderConfig(**arch)).train()
    method = get_method("m2_encoder")
    module = TrainingModule(method, model, GroupedContrastiveLoss(), method.engine_needs(model, cast(Any, None)))
    rows, size, tokens = 8, arch["image_size"], arch["context_length"]
    batches = [
        {
            "image": torch.randint(0, 256, (rows, 3, size, size), dtype=torch.uint8),
            "input_ids": torch.randint(1, 50, (rows, tokens)),
            "attention_mask": torch.ones(rows, tokens, dtype=torch.long),
        }
        for _ in range(4)
    ]

    def backward(terms):
        sum(loss_terms(terms).values()).backward()

    def pool_pass():
        with torch.no_grad():
            return module(batches, entry="pool")

    def separate():
        pool = pool_pass()
        for index, batch in enumerate(batches):
            backward(module(batch, pool, index))

    def counted(step) -> int:
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        return counter.get_total_flops()

    merged, separate_flops, pool = (
        counted(lambda: backward(module(batches, entry="merged"))),
        counted(separate),
        counted(pool_pass),
    )
    assert pool <= separate_flops - merged <= 1.01 * pool
    assert merged <= 0.8 * separate_flops


class StoppedClock:
    """A host clock that reads the times it is given, one per mark."""

    def __init__(self, *times: float):
        self.times = list(times)

    def mark(self) -> float:
        return self.times.pop(0)

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


def logged_window(tmp_path, peak, flops_per_sample, excluded=0.0):
    from mmpt.engine.metrics import MetricLogger

    tmp_path.mkdir(exist_ok=True)
    logger = MetricLogger(
        tmp_path, max_steps=10, start_step=0, global_batch=8, tensorboard=False, progress_bar=False, peak_tflops=peak
    )
    logger.flops_per_sample = flops_per_sample
    logger.clock, logger._window_start = cast(Any, StoppedClock(2.0, 0.0)), 0.0  # the window ends 2 s in
    logger.update({"contrastive": torch.tensor(1.0)})
    logger.update({"contrastive": torch.tensor(1.0)})
    logger.exclude(excluded)
    record = logger.reduce(2, 0.1, {})
    logger.write(2, record)
    logger.close()
    return record, json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_window_states_tflops_and_mfu_from_the_count_its_samples_and_its_time(tmp_path, capsys):
    record, written = logged_window(tmp_path, peak=100.0, flops_per_sample=3e12)
    # 2 steps x 8 samples x 3 TFLOP in 2 s on one GPU: 24 TFLOP/s, 24% of a 100 TFLOP/s peak.
    assert written["samples_per_s"] == pytest.approx(8.0)
    assert written["perf/tflops"] == pytest.approx(24.0) and written["perf/mfu"] == pytest.approx(0.24)
    assert "tflops=24.0 mfu=24.0%" in capsys.readouterr().out
    excluded, _ = logged_window(tmp_path / "again", peak=100.0, flops_per_sample=3e12, excluded=0.5)
    assert excluded["perf/tflops"] == pytest.approx(32.0)  # the counting's own time is not the window's


def test_no_peak_no_claim(tmp_path):
    record, written = logged_window(tmp_path, peak=None, flops_per_sample=3e12)
    assert not [key for key in written if key.startswith("perf/")]


def test_the_peak_is_the_configured_one_or_a_known_gpus_bf16_peak(monkeypatch):
    from mmpt.engine.flops import peak_tflops

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_tflops(None, "bf16", cpu) is None and peak_tflops(None, "fp32", cpu) is None
    assert peak_tflops(50.0, "fp32", cpu) == 50.0
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_tflops(None, "bf16", gpu) == peak
        assert peak_tflops(None, "fp32", gpu) is None  # bf16 peaks only for bf16 runs
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert peak_tflops(None, "bf16", gpu) is None


def test_a_training_run_with_a_stated_peak_logs_mfu_from_its_counted_step(
    tmp_path, digits_root, process_group_of_one, monkeypatch
):
    """In this process, a tiny CLIP run: the step is counted once, on the first micro-batch's shapes, and every
    window's perf/tflops is that count x samples/s."""
    from mmpt.engine import flops, run

    counts: list[tuple[int, dict]] = []

    def counting(method, cfg, run_dir, batch):
        counts.append((flops.step_flops(method, cfg, run_dir, batch), {k: tuple(v.shape) for k, v in batch.items()}))
        return counts[-1][0]

    monkeypatch.setattr(run, "step_flops", counting)
    run_dir = tmp_path / "run"
    cfg = small_clip_demo(
        digits_root,
        run_dir,
        "train.max_steps=3",
        "train.peak_tflops=0.5",
        f'data.train.sources=[{{shards: "{digits_root}/train/en-*.tar"}}]',
        "data.train.batch_size=4",
        "data.train.shuffle_buffer=8",
        "data.eval=[]",
        "train.log_every=1",
    )
    train_in_process(cfg)
    assert len(counts) == 1, counts  # once, not per step
    step, shapes = counts[0]
    assert all(shape[0] == 4 for shape in shapes.values()), shapes  # the micro-batch's own shapes
    windows = [r for r in read_metrics(run_dir) if "samples_per_s" in r]
    assert len(windows) == 3
    for record in windows:
        assert record["perf/tflops"] == pytest.approx(step / 4 * record["samples_per_s"] / 1e12)
        assert record["perf/mfu"] == pytest.approx(record["perf/tflops"] / 0.5)

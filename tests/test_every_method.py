"""Every registered method end to end in one process (a world of one), at the size its `tiny_overrides` give:
build, train 2 steps, checkpoint, resume for a third, write the final weights, evaluate, load the run back.

The fast tier's signal that each method still trains; the launches (config matrix, faults, multi-node) cover
ranks, ZeRO stages and precisions. A method registered later is picked up by `list_methods()`.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
from test_config_matrix import CONFIGS, shipped, shrink

from conftest import REPO, read_metrics
from mmpt.methods import list_methods


@pytest.fixture(scope="module")
def one_process(process_group_of_one):
    """This module's runs in the session's process group of one (conftest.py), with the rendezvous variables
    `train` sets for a plain `python` start removed afterwards, so that later launches start clean."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def demo_config(name: str) -> Path:
    """configs/<name>/demo.yaml, or else the first shipped config of the method."""
    demo = REPO / "configs" / name / "demo.yaml"
    if demo.is_file():
        return demo
    own = [c for c in CONFIGS if shipped(c).method_name == name]
    assert own, f"method '{name}' ships no config under configs/"
    return own[0]


@pytest.mark.parametrize("name", list_methods())
def test_method_trains_resumes_evaluates_and_loads(name, corpora, one_process, tmp_path, caplog):
    import logging

    import torch
    from safetensors.torch import load_file

    import mmpt
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    config = demo_config(name)
    run_dir = tmp_path / "run"
    overrides = [
        *shrink(config, corpora),  # the shared test settings and the method's own tiny_overrides
        f"run.output_dir={run_dir}",
        "train.save_every=2",
        "train.eval_every=2",
        "train.zero_stage=0",
        "train.precision=fp32",
        "optim.min_lr_ratio=1.0",  # a constant learning rate after warmup: the resumed step moves the weights
    ]
    caplog.set_level(logging.INFO, logger="mmpt")
    train(load_config(config, [*overrides, "train.max_steps=2"]))
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary"))
    # the configs whose loss pools their micro-batches (GBA-ITC; pooled_accumulation), none checkpointing
    pooled = {"m2_encoder": 2, "transformers": 4}.get(name)
    says = f"pooled accumulation: the loss over all {pooled} micro-batches, a pool pass without gradient first"
    assert says in summary if pooled else "pooled" not in summary, summary
    if name == "space2":  # its config starts the dialog encoder from a checkpoint (the packaged MiniLM)
        assert "initial weights: dialog encoder from " in summary, summary
    assert (run_dir / "checkpoints/step_000000002/complete.json").is_file(), "no complete checkpoint at step 2"
    at_step_2 = load_file(str(run_dir / "model.safetensors"))

    results = train(load_config(config, [*overrides, "train.max_steps=3"]))  # resumes from the step-2 checkpoint
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")][-1]
    assert re.search(r"initial weights: .* \(at the run's start; the checkpoint's now\)\n  resuming from ", summary)

    records = read_metrics(run_dir)
    losses = [(r["step"], r["loss/total"]) for r in records if "loss/total" in r]
    assert [step for step, _ in losses] == [1, 2, 3], f"logged steps {losses}: the second start did not resume at 2"
    assert all(math.isfinite(loss) for _, loss in losses), losses
    evaluated = [r["step"] for r in records if any(k.startswith("eval/") for k in r)]
    assert evaluated == [2, 3], f"evaluations at steps {evaluated}, not at each run's end"
    metrics = {k: v for k, v in results.items() if k.startswith("eval/") and not k.endswith("/seconds")}
    assert metrics, f"the final evaluation returned no metric: {results}"
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics

    # Resumed, not restarted: Adam's state went on counting from step 2, and every weight is the step-2 weight
    # moved by one step (Adam moves an element by about the learning rate a step; a model built afresh, even
    # with the same seed, is two steps away; the learning rate is kept constant here, see above).
    steps, rates = optimizer_state(run_dir / "checkpoints/step_000000003")
    assert steps == {3}, f"Adam's step count at step 3 is {steps}: its state was not restored"
    final = load_file(str(run_dir / "model.safetensors"))
    assert final.keys() == at_step_2.keys()
    model = mmpt.load(run_dir)  # a freshly built model with the final weights loaded strictly
    assert model.config.method_name == name
    moved = {
        key: float((final[key].double() - at_step_2[key].double()).abs().max())
        for key, _ in model.model.named_parameters()
    }
    farthest = sorted(moved.items(), key=lambda kv: -kv[1])[:3]
    assert max(moved.values()) > 0, "step 3 left every weight as step 2 saved it"
    assert max(moved.values()) <= 1.5 * max(rates), (
        f"weights at step 3 are farther from step 2's than one step at learning rate {max(rates)} goes (the resume "
        f"did not restore them): {farthest}"
    )

    loaded = model.model.state_dict()
    assert loaded.keys() == final.keys(), sorted(set(loaded) ^ set(final))[:5]
    for key, value in final.items():
        torch.testing.assert_close(loaded[key].to(value.dtype), value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def optimizer_state(checkpoint: Path) -> tuple[set[int], set[float]]:
    """(Adam's step counts, the param groups' learning rates) in a checkpoint's files."""
    import torch

    steps, rates = set(), set()

    def visit(node):
        if isinstance(node, dict):
            if "exp_avg_sq" in node and "step" in node:
                steps.add(int(node["step"]))
            if "params" in node and "lr" in node:
                rates.add(float(node["lr"]))
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    for path in sorted(checkpoint.glob("*.pt")):
        visit(torch.load(path, map_location="cpu", weights_only=False))
    assert steps and rates, f"no Adam state in {checkpoint}"
    return steps, rates


def test_a_run_with_nothing_to_evaluate_builds_no_evaluation_model(corpora, one_process, tmp_path, monkeypatch):
    """Training ends with the weights written and no second, whole model built for an evaluation that has no work."""
    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.methods import get_method

    config = demo_config("clip")
    cfg = load_config(
        config,
        [
            *shrink(config, corpora),
            f"run.output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.save_every=0",
            "train.eval_every=0",
            "train.zero_stage=0",
            "train.precision=fp32",
            "data.eval=[]",
        ],
    )
    method = get_method(cfg.method_name)
    assert not cfg.data.eval
    builds = []
    build_model = method.build_model
    monkeypatch.setattr(method, "build_model", lambda *args: builds.append(args) or build_model(*args))
    assert train(cfg) == {}
    assert (tmp_path / "run/model.safetensors").is_file()
    assert len(builds) == 1, f"the model was built {len(builds)} times: once for training only"


@pytest.mark.parametrize("tf32", [True, False])
def test_the_model_runs_its_fp32_products_as_train_tf32_says(tf32, corpora, one_process, tmp_path, monkeypatch):
    """`train.tf32` (on by default) is the matmul and convolution setting the training steps run under."""
    import torch

    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.methods import get_method

    config = demo_config("clip")
    overrides = [
        "train.max_steps=1",
        "train.save_every=0",
        "train.eval_every=0",
        "data.eval=[]",
        f"train.tf32={str(tf32).lower()}",
    ]
    cfg = load_config(config, [*shrink(config, corpora), f"run.output_dir={tmp_path / 'run'}", *overrides])
    method, seen = get_method(cfg.method_name), []
    step = method.training_step
    backends = torch.backends

    def recording(*args, **kwargs):
        seen.append((backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32))
        return step(*args, **kwargs)

    monkeypatch.setattr(method, "training_step", recording)
    train(cfg)
    assert seen and set(seen) == {(tf32, tf32)}, seen


@pytest.mark.parametrize("name", list_methods())
def test_bf16_at_zero_0_is_autocast_over_an_fp32_model(name, corpora, one_process, tmp_path):
    """bf16 without ZeRO keeps the model, its gradients and their sums over micro-batches in fp32 and runs the
    plain fused AdamW, while every linear layer of the forward (the momentum copies' included) computes in bf16:
    not DeepSpeed's bf16 mode, whose ZeRO-0 steps parameter by parameter and sums micro-batches in bf16."""
    import torch
    from torch import nn

    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.data import StatefulLoader
    from mmpt.engine.optim import SkippingAdamW
    from mmpt.engine.run import build_engine, prepare_run_dir, start_process_group
    from mmpt.engine.trainer import optimizer_step, to_device
    from mmpt.methods import get_method

    config, run_dir = demo_config(name), tmp_path / "run"
    overrides = [f"run.output_dir={run_dir}", "train.zero_stage=0", "train.precision=bf16", "train.grad_accum=2"]
    cfg = load_config(config, [*shrink(config, corpora), *overrides])
    method = get_method(name)
    start_process_group(cfg.train.watchdog_timeout)  # the session's world of one, started here if not yet
    prepare_run_dir(cfg, method, run_dir)
    engine, _, _ = build_engine(cfg, method, mdist.ParallelLayout.whole_world(), 1)
    try:
        assert isinstance(engine.optimizer, SkippingAdamW), type(engine.optimizer).__name__
        assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
        computed: list[torch.dtype] = []
        for module in engine.module.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda m, args, out: computed.append(out.dtype))
        gradients: list[torch.dtype] = []
        for param in engine.module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p: gradients.append(p.grad.dtype))
        batches = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=0, world_size=1)))
        micro_batches = [to_device(next(batches), engine.device, torch.float32) for _ in range(2)]
        losses = optimizer_step(engine, micro_batches)
        assert computed and set(computed) == {torch.bfloat16}, set(computed)
        assert gradients and set(gradients) == {torch.float32}, set(gradients)
        assert all(torch.isfinite(v).all() for v in losses.values()), losses
        assert engine.was_step_applied()
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_never_synchronizes_the_device_in_a_step(stage, corpora, one_process, tmp_path, monkeypatch):
    """DeepSpeed's throughput timer, on unless a config turns it off, waits for the whole device at every forward
    and every step (invisible to CUDA's sync debug mode, which sees single reads): mmpt times its own spans and
    keeps it off. Counted here at the accelerator's `synchronize` that the timer calls, over steps past the
    timer's start."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from mmpt import distributed as mdist
    from mmpt.config_loader import load_config
    from mmpt.data import StatefulLoader
    from mmpt.engine.run import build_engine, prepare_run_dir, set_training_precision, start_process_group
    from mmpt.engine.trainer import optimizer_step, to_device
    from mmpt.methods import get_method

    config, run_dir = demo_config("clip"), tmp_path / "run"
    overrides = [f"run.output_dir={run_dir}", f"train.zero_stage={stage}", "train.precision=bf16", "train.grad_accum=2"]
    cfg = load_config(config, [*shrink(config, corpora), *overrides])
    method = get_method("clip")
    start_process_group(cfg.train.watchdog_timeout)
    prepare_run_dir(cfg, method, run_dir)
    engine, _, _ = build_engine(cfg, method, mdist.ParallelLayout.whole_world(), 1)
    floats = set_training_precision(engine, cfg)  # autocast over fp32 at ZeRO-0, DeepSpeed's bf16 above
    accelerator = get_accelerator()
    calls: list[str] = []
    monkeypatch.setattr(type(accelerator), "synchronize", lambda self, device_index=None: calls.append("accelerator"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("torch.cuda"))
    try:
        batches = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=0, world_size=1)))
        for _ in range(4):  # the timer synchronizes from its third step on
            micro_batches = [to_device(next(batches), engine.device, floats) for _ in range(2)]
            optimizer_step(engine, micro_batches)
        assert engine.global_steps == 4
        assert not calls, f"ZeRO-{stage}: {len(calls)} device-wide synchronizations in 4 steps ({set(calls)})"
    finally:
        engine.destroy()


def test_the_progress_bar_ends_its_line_before_the_final_evaluation(corpora, one_process, tmp_path, capfd, monkeypatch):
    """In a log holding stdout and stderr, `final evaluation: ...` starts a line of its own."""
    from mmpt.config_loader import load_config
    from mmpt.engine import trainer

    written_before: list[str] = []
    evaluate = trainer.final_evaluation

    def final_evaluation(*args, **kwargs):
        written_before.append(capfd.readouterr().err)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer, "final_evaluation", final_evaluation)
    config = demo_config("clip")
    settings = ["train.max_steps=2", "train.zero_stage=0", "run.progress_bar=true", f"run.output_dir={tmp_path}"]
    trainer.train(load_config(config, [*shrink(config, corpora), *settings]))
    (stderr,) = written_before
    assert "train: 100%" in stderr and stderr.endswith("\n"), stderr[-300:]

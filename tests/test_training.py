"""End-to-end training under the real launchers: deepspeed (2 CPU ranks), torchrun, plain python."""

import json
import sys

import pytest

from conftest import REPO, free_port, read_metrics, run_command, run_tool, step_losses, tiny_config, write_config
from pool import scenario

pytestmark = pytest.mark.distributed


def mean(values):
    return sum(values) / len(values)


def assert_loss_went_down(run_dir):
    losses = [step_losses(run_dir)[s] for s in sorted(step_losses(run_dir))]
    assert mean(losses[-4:]) < mean(losses[:4]) - 0.3, losses


TWO_RANKS = {"zero2-fp32": (2, "fp32", 1, False), "zero3-bf16-accum2-offload": (3, "bf16", 2, True)}


def two_ranks(name: str, stage: int, precision: str, accum: int, offload: bool) -> str:
    @scenario(f"training-{name}")
    def build(corpora, run_dir):
        train = {
            "zero_stage": stage,
            "precision": precision,
            "grad_accum": accum,
            "offload_optimizer": offload,
            "max_steps": 16,
            "save_every": 4,
            "keep_last": 2,
        }
        return tiny_config(corpora["digits"], run_dir, train=train), [], "train"

    return f"training-{name}"


SCENARIO_NAMES = [two_ranks(name, *settings) for name, settings in TWO_RANKS.items()]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.pool(n), id=n) for n in SCENARIO_NAMES])
def test_deepspeed_two_ranks_lower_the_loss(rank_pool, name):
    run_dir = rank_pool.run_dir(name)
    assert_loss_went_down(run_dir)
    records = read_metrics(run_dir)
    assert all(len(r["step_time_per_rank"]) == 2 for r in records if "step" in r and "loss/total" in r)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000000012", "step_000000016"]  # keep_last=2
    assert (run_dir / "checkpoints/latest").read_text() == "step_000000016"
    assert {f"rank_{r}.pt" for r in (0, 1)} <= {p.name for p in (run_dir / "checkpoints/step_000000016").iterdir()}
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "config.yaml").is_file()
    # the default config on 2 ranks: torch.distributed's and DeepSpeed's collectives are the libraries' own
    assert rank_pool.record(name)["replaced_collectives"] == []


def test_torchrun_two_ranks_zero0_lowers_the_loss(tmp_path, digits_root):
    run_dir = tmp_path / "run"
    cfg = tiny_config(digits_root, run_dir, train={"zero_stage": 0, "max_steps": 24, "save_every": 0})
    config = write_config(tmp_path / "cfg.yaml", cfg)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(REPO / "launch/train.py"),
        "--config",
        str(config),
    ]
    run_command(command)
    assert_loss_went_down(run_dir)


def test_plain_python_trains_evaluates_and_zeroshot_cli_reproduces(tmp_path, digits_root):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        digits_root,
        run_dir,
        train={"zero_stage": 0, "max_steps": 6, "save_every": 0},
        data={
            "eval": [
                {"dataset": str(digits_root / "zeroshot"), "task": "zeroshot_classification", "languages": ["en", "zh"]}
            ]
        },
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    run_tool("train", "--config", str(config))
    final = read_metrics(run_dir)[-1]
    out = tmp_path / "zh.json"
    args = ["--model", str(run_dir), "--dataset", str(digits_root / "zeroshot"), "--language", "zh"]
    run_tool("zeroshot", *args, "--output", str(out), timeout=300)
    record = json.loads(out.read_text())
    assert record["task"] == "zeroshot_classification" and record["language"] == "zh"
    assert set(record["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}
    for key, value in record["metrics"].items():
        assert value == pytest.approx(final[f"eval/zeroshot/zh/{key}"], abs=1e-6)

    # The CLIP_benchmark loader gives the same embeddings as the run's own model.
    import torch

    from mmpt.clip_benchmark import load_mmpt
    from mmpt.release import load_run

    model, transform, tokenizer = load_mmpt("mmpt", str(run_dir))
    cfg, method, own = load_run(run_dir)
    texts = ["a handwritten seven", "手写的数字七"]
    tokens = method.tokenizer(cfg, run_dir)(texts)
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_text(tokenizer(texts)), own.encode_text(tokens["input_ids"], tokens["attention_mask"])
        )


def test_m2_encoder_trains_from_an_official_checkpoint_with_pooled_accumulation(tmp_path, digits_root):
    import torch
    from safetensors.torch import load_file

    from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig

    arch = {
        "vocab_size": 1000,
        "width": 32,
        "heads": 2,
        "lower_layers": 1,
        "shared_layers": 1,
        "output_dim": 16,
        "position_init_std": 0.02,
    }
    official = M2Encoder(M2EncoderConfig(**{**PRESETS["m2-encoder-demo"], **arch})).state_dict()
    official["logit_scale"] = official["logit_scale"].reshape(())  # released files store it 0-D
    torch.save({"state_dict": official}, tmp_path / "official.ckpt")

    run_dir = tmp_path / "run"
    cfg = tiny_config(
        digits_root,
        run_dir,
        train={"zero_stage": 0, "max_steps": 2, "grad_accum": 2, "save_every": 0},
        optim={"lr": 1e-12, "warmup_steps": 0, "weight_decay": 0.0},
    )
    cfg["method"] = {
        "name": "m2_encoder",
        "model": "m2-encoder-demo",
        "arch": arch,
        "tokenizer": str(digits_root / "tokenizer.json"),
        "init_from": str(tmp_path / "official.ckpt"),
        "loss": {"group_size": "world", "accumulation_steps": 2, "tile_size": 8},
        "augment": {"hflip": False, "randaugment": False},
    }
    config = write_config(tmp_path / "cfg.yaml", cfg)
    run_tool("train", "--config", str(config))
    trained = load_file(str(run_dir / "model.safetensors"))
    for key in ("backbone.text_embed.weight", "itc_vl_image_proj.fc.weight", "backbone_vl.layers.0.ffn.A.fc1.weight"):
        torch.testing.assert_close(trained[key], official[key], atol=1e-6, rtol=0)
    assert all(r["loss/total"] > 0 for r in read_metrics(run_dir) if "loss/total" in r)

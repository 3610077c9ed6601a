"""`train.eval_every`: the data.eval sets evaluated while training, reported as eval/<set>/<language>/<metric>,
leave training exactly as it would be without them, and a run stopped after an evaluation resumes exactly."""

import pytest

from conftest import read_metrics, run_deepspeed, step_losses, tiny_config, write_config


def config(tmp_path, digits_root, name, zero_stage, **train):
    cfg = tiny_config(digits_root, tmp_path / name, train={"max_steps": 4, "save_every": 0, **train})
    cfg["train"]["zero_stage"] = zero_stage
    cfg["data"]["eval"] = [  # the text tower has dropout: an evaluation that moved the RNG would change training
        {"dataset": str(digits_root / "zeroshot"), "task": "zeroshot_classification", "languages": ["en", "zh"]},
        {
            "dataset": str(digits_root / "zeroshot/retrieval_zh.jsonl"),
            "task": "zeroshot_retrieval",
            "name": "digits_retrieval",
            "languages": ["zh"],
        },
    ]
    return write_config(tmp_path / f"{name}.yaml", cfg)


def weights(run_dir):
    return (run_dir / "model.safetensors").read_bytes()


def evaluations(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if any(k.startswith("eval/") for k in r)}


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_evaluating_while_training_changes_nothing_and_resumes_exactly(tmp_path, digits_root, zero_stage):
    run_deepspeed(config(tmp_path, digits_root, "plain", zero_stage))
    if zero_stage == 0:
        run_deepspeed(config(tmp_path, digits_root, "evaluated", zero_stage, eval_every=2))
    else:  # stopped at step 2, right after an evaluation and a checkpoint, then resumed to step 4
        evaluated = config(tmp_path, digits_root, "evaluated", zero_stage, eval_every=1, save_every=2)
        run_deepspeed(evaluated, "train.max_steps=2")
        assert "resumed from" in (out := run_deepspeed(evaluated)).stdout + out.stderr
    plain, evaluated_dir = tmp_path / "plain", tmp_path / "evaluated"
    assert step_losses(plain) == step_losses(evaluated_dir)
    assert weights(plain) == weights(evaluated_dir)  # bit for bit
    during = evaluations(evaluated_dir)
    expected_steps = {2, 4} if zero_stage == 0 else {1, 2, 3, 4}
    assert set(during) == expected_steps, sorted(during)  # every eval_every steps, and at the end
    assert set(evaluations(plain)) == {4}  # eval_every 0: at the end only
    for record in during.values():
        for language in ("en", "zh"):
            assert 0 <= record[f"eval/zeroshot/{language}/acc1"] <= 1
        assert 0 <= record["eval/digits_retrieval/zh/text_retrieval_recall@1"] <= 1
        assert record["eval/zeroshot/seconds"] > 0


def test_an_evaluation_that_draws_random_numbers_and_switches_modes_leaves_both_as_they_were():
    import random

    import numpy as np
    import torch

    from mmpt.engine.evaluation import untouched

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    model[0].eval()  # a module kept in eval mode while training (a frozen tower) stays so

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = draws()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with untouched(model):
        model.eval()
        draws(), draws()
    assert draws() == expected
    assert model.training and not model[0].training and model[1].training

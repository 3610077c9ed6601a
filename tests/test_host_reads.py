"""Training steps of every method make no host read in mmpt's own code, nor at ZeRO 1-2 in DeepSpeed's (what
would stall a GPU step).

One shipped config per method (shrunk as in the config matrix) and the open_clip method train 5 steps
on 2 ranks under the deepspeed launcher with `grad_accum: 2` at ZeRO 2, and the first of them at ZeRO 0
too; steps 2-4 neither log nor checkpoint, and there every `.item()`, `.tolist()`, `.cpu()`,
`int()`/`float()`/`bool()` of a tensor ... whose caller is in mmpt/, data/ or losses/ (or, at ZeRO 1-2,
DeepSpeed) is counted (tests/host_reads_runner.py). Loss terms are summed on the device and read at logging steps only.
"""

import json
from pathlib import Path

import pytest
from test_config_matrix import CONFIGS, shipped, shrink

from conftest import REPO, deepspeed_launch, run_command, tiny_config, write_config

pytestmark = pytest.mark.distributed

# Evaluation while training reads its results back by design: what is counted are the training steps.
STEPS = ["train.max_steps=5", "train.log_every=5", "train.save_every=0", "train.grad_accum=2", "train.eval_every=0"]


def one_config_per_method() -> list[Path]:
    chosen: dict[str, Path] = {}
    for config in CONFIGS:
        chosen.setdefault(shipped(config).method_name, config)
    return list(chosen.values())


def test_training_steps_read_nothing_back_to_the_host(corpora, tmp_path, digits_root):
    open_clip = tiny_config(digits_root, tmp_path / "unused")
    open_clip["method"] = {"name": "open_clip", "model": str(REPO / "mmpt/models/bench-vit-tiny.json")}
    open_clip["data"]["train"]["batch_size"] = 4
    configs = [(config, shrink(config, corpora)) for config in one_config_per_method()]
    configs.append((write_config(tmp_path / "open_clip.yaml", open_clip), ["run.progress_bar=false"]))
    cells = []
    for index, (config, overrides) in enumerate(configs):
        for stage in (0, 2) if index == 0 else (2,):
            name = f"{config.stem if config.parent == tmp_path else config.relative_to(REPO / 'configs')}:zero{stage}"
            cells.append(
                {
                    "name": name,
                    "config": str(config),
                    "overrides": [*overrides, *STEPS, f"train.zero_stage={stage}"],
                    "run_dir": str(tmp_path / name.replace("/", "-").replace(":", "-")),
                }
            )
    cells_file, results = tmp_path / "cells.json", tmp_path / "results.jsonl"
    cells_file.write_text(json.dumps(cells))
    run_command(
        deepspeed_launch("tests/host_reads_runner.py", str(cells_file), str(results)), cwd=tmp_path, timeout=900
    )
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((line["cell"], line["rank"]) for line in lines) == sorted(
        (c["name"], r) for c in cells for r in (0, 1)
    )
    for line in lines:
        assert line["counted_steps"] == [2, 3, 4], line
    reads = {f"{line['cell']} rank {line['rank']}": line["reads"] for line in lines if line["reads"]}
    assert not reads, json.dumps(reads, indent=1)


class NanAtStep:
    """A loss hook making step `step`'s loss NaN, and an observer of where the run is."""

    def __init__(self, step: int, reads):
        self.step, self.now, self.reads = step, 0, reads

    def reached(self, point: str, step: int) -> None:
        self.now = step
        self.reads.phase(point, step)

    def loss(self, total):
        return total * float("nan") if self.now == self.step else total


def zero_run(digits_root, run_dir, stage: int, precision: str):
    from mmpt.config_loader import load_config

    steps = {"max_steps": 5, "log_every": 1, "save_every": 0, "grad_accum": 2, "eval_every": 0, "grad_clip": 0.5}
    config = tiny_config(digits_root, run_dir, train={**steps, "zero_stage": stage, "precision": precision})
    config["data"]["train"]["num_workers"] = 0
    return load_config(write_config(run_dir.parent / f"{run_dir.name}.yaml", config))


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_zero_1_2_steps_read_nothing_back_and_skip_a_non_finite_step_on_the_device(
    stage, precision, digits_root, process_group_of_one, tmp_path, monkeypatch
):
    """DeepSpeed's own ZeRO-1/2 step reads its overflow flag and the norm's validity back (the stock check fails
    this test); here a NaN loss at step 3 is skipped on the device and nothing is read back in steps 2-4 but
    at logging, DeepSpeed's code included. ZeRO-1 in bf16 is DeepSpeed's BF16_Optimizer, ZeRO-2 its ZeRO
    optimizer; both clip (grad_clip)."""
    import deepspeed
    import torch
    from host_reads_runner import READS, HostReads
    from safetensors.torch import load_file

    from conftest import read_metrics, train_in_process
    from mmpt.engine import hooks

    reads = HostReads()
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, reads._counted(getattr(torch.Tensor, name), name))
    nan = NanAtStep(3, reads)
    monkeypatch.setattr(hooks, "_ADDED", [(nan.reached, nan.loss)])
    cfg = zero_run(digits_root, tmp_path / "run", stage, precision)
    reads.reset({2, 3, 4}, (str(Path(deepspeed.__file__).parent) + "/",))
    train_in_process(cfg)
    assert reads.counted_steps == {2, 3, 4}
    assert not reads.seen, dict(reads.seen)
    skipped = {r["step"]: r["skipped_steps"] for r in read_metrics(tmp_path / "run") if "skipped_steps" in r}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "run/model.safetensors")).values())


@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_zero_1_2_steps_skipping_on_the_device_equal_deepspeeds_own(
    stage, precision, digits_root, process_group_of_one, tmp_path, monkeypatch
):
    """The same run with DeepSpeed's own non-finite check (its stock step, host reads and all) ends with the
    same weights: the device-side check and clip change no finite step."""
    import torch
    from safetensors.torch import load_file

    from conftest import train_in_process
    from mmpt.engine import deepspeed_config, run

    train_in_process(zero_run(digits_root, tmp_path / "device", stage, precision))
    for module in (run, deepspeed_config):
        monkeypatch.setattr(module, "skips_on_device", lambda train: False)
    train_in_process(zero_run(digits_root, tmp_path / "stock", stage, precision))
    ours, stock = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("device", "stock"))
    assert ours.keys() == stock.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], stock[name], rtol=0, atol=1e-6, msg=name)

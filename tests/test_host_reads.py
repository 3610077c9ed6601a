"""Training steps of every method make no host read in mmpt's own code (what would stall a GPU step).

One shipped config per method (shrunk as in the config matrix) and the open_clip method train 5 steps
on 2 ranks under the deepspeed launcher with `grad_accum: 2` at ZeRO 2, and the first of them at ZeRO 0
too (where the non-finite skip is mmpt's own, not DeepSpeed's); steps 2-4 neither log nor checkpoint, and there
every `.item()`, `.tolist()`, `.cpu()`,
`int()`/`float()`/`bool()` of a tensor ... whose caller is in mmpt/, data/ or losses/ is counted
(tests/host_reads_runner.py). Loss terms are summed on the device and read at logging steps only.
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
    open_clip["method"] = {
        "name": "open_clip",
        "model": str(REPO / "benchmarks/configs/bench-vit-tiny.json"),
    }
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

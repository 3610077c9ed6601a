"""docs/train_on_your_data.md, followed as written at test size: img2dataset-style bilingual shards, an
"official download" folder (a checkpoint in the official layout and a GLM sp.model), the guide's config with
two sources reading different json fields, its launch, zero-shot and export commands."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from img2dataset_shards import write_set, write_shard

from conftest import REPO, deepspeed_launch, read_metrics, run_command

GUIDE = REPO / "docs/train_on_your_data.md"
# The 0.4b config at test size, on CPU ranks: command-line overrides only, as a user shrinks a config.
SHRINK = [
    "method.arch.width=32",
    "method.arch.heads=2",
    "method.arch.lower_layers=1",
    "method.arch.shared_layers=1",
    "method.arch.ffn_width=64",
    "method.arch.output_dim=16",
    "method.arch.image_size=32",
    "method.arch.patch_size=8",
    "method.arch.position_init_std=0.02",
    "method.loss.group_size=world",
    "method.loss.tile_size=6",
    "method.augment.randaugment=false",
    "method.eval_batch_size=64",
    "data.train.batch_size=4",
    "data.train.num_workers=1",
    "data.train.shuffle_buffer=20",
    "train.max_steps=2",
    "train.eval_every=1",
    "train.log_every=1",
    "train.save_every=0",
    "train.precision=fp32",
    "optim.warmup_steps=1",
    "run.progress_bar=false",
    "run.tensorboard=false",
]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def official_download(folder: Path, config: Path, sp_model: Path) -> None:
    """A checkpoint in the official (Lightning) layout of the shrunk model, with the sp.model beside it."""
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    folder.mkdir(parents=True)
    shutil.copyfile(sp_model, folder / "sp.model")
    cfg = load_config(config, [*SHRINK, "method.init_from=null", f"method.tokenizer={folder / 'sp.model'}"])
    torch.manual_seed(1)
    model = get_method("m2_encoder").build_model(cfg, folder)
    state = {k: (v.reshape(()) if k in ("logit_scale", "logit_vl_scale") else v) for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 0}, folder / "m2_encoder.ckpt")


@pytest.mark.distributed
def test_the_guide_trains_evaluates_and_releases(tmp_path, digits_root, glm_sp_model):
    os.symlink(REPO / "configs", tmp_path / "configs")
    write_set(tmp_path / "shards/web", shards=4, per_shard=24)
    write_shard(tmp_path / "shards/heldout", 0, 16, start=1000)
    (tmp_path / "eval").mkdir()
    os.symlink(digits_root / "zeroshot", tmp_path / "eval/my_classes")
    (tmp_path / "my_run.yaml").write_text(blocks("yaml")[0])
    official_download(tmp_path / "official/M2-Encoder", tmp_path / "my_run.yaml", glm_sp_model)

    launch, evaluate = blocks("bash")
    words = launch.split()
    assert words[:3] == ["deepspeed", "--num_gpus", "8"] and words[3:] == ["launch/train.py", "--config", "my_run.yaml"]
    trained = run_command(deepspeed_launch("launch/train.py", *words[4:], *SHRINK), cwd=tmp_path)
    output = trained.stdout + trained.stderr
    assert re.search(
        r"initial weights: initialised (\d+) of \1 tensors from .*official/M2-Encoder/m2_encoder.ckpt "
        r"\(official-m2, strict\)",
        output,
    ), output[-3000:]
    run_dir = tmp_path / "runs/my-m2"
    assert (run_dir / "sp.model").read_bytes() == glm_sp_model.read_bytes()  # the download's tokenizer
    counts = json.loads((run_dir / "summary.json").read_text())["data"]
    assert all(counts[source]["decoded"] > 0 and counts[source]["skipped"] == 0 for source in ("en", "zh"))
    evaluated = {r["step"]: r for r in read_metrics(run_dir) if "eval/my_classes/seconds" in r}
    assert set(evaluated) == {1, 2}  # eval_every 1, and at the end
    assert all(
        {"eval/my_classes/en/acc1", "eval/my_classes/zh/acc1", "eval/heldout_zh/zh/mean_recall"} <= set(r)
        for r in evaluated.values()
    )

    for line in evaluate.strip().splitlines():
        words = line.split()
        assert words[0] == "python"
        run_command([sys.executable, str(REPO / words[1]), *words[2:]], cwd=tmp_path)
    (record,) = (tmp_path / "results").glob("*.json")
    assert json.loads(record.read_text())["language"] == "zh"
    from mmpt import load

    assert load(str(tmp_path / "releases/my-m2")).config.method.init_from == "official/M2-Encoder"

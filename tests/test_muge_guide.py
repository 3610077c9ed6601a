"""docs/muge_zh.md followed as written at test size: a MUGE-layout set (base64 images in tsv, Chinese captions with
their ids) of digit scans, a tiny ChineseCLIPModel saved with `save_pretrained` in place of the hub name, the
guide's conversion, fine-tuning (in this process, one rank), evaluation with the predictions file and export,
each command as the guide writes it."""

from __future__ import annotations

import base64
import json
import re
import shlex

import torch
from test_every_method import one_process  # noqa: F401  (a fixture)

from conftest import REPO

GUIDE = REPO / "docs/muge_zh.md"
HUB_NAME = "OFA-Sys/chinese-clip-vit-base-patch16"
SHRINK = [  # the shipped config at test size, as a user shrinks one on the command line
    "train.max_steps=2",
    "train.grad_accum=1",
    "train.zero_stage=0",
    "train.precision=fp32",
    "train.log_every=1",
    "train.save_every=0",
    "data.train.batch_size=4",
    "data.train.num_workers=1",
    "data.train.shuffle_buffer=10",
    "optim.warmup_steps=1",
    "method.eval_batch_size=16",
    "run.progress_bar=false",
    "run.tensorboard=false",
]


def commands() -> list[list[str]]:
    text = "\n".join(re.findall(r"```bash\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S))
    return [shlex.split(line) for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def muge_split(folder, split: str, samples, classnames) -> None:
    """`<split>_imgs.tsv` and `<split>_texts.jsonl` as MUGE ships them: a caption per scan, ids of their own, the
    images in URL-safe base64 (Chinese-CLIP's own tools write and read that alphabet)."""
    tsv = "".join(f"{700 + i}\t{base64.urlsafe_b64encode(image).decode()}\n" for i, (image, _, _) in enumerate(samples))
    assert {"-", "_"} & set(tsv), "no image's base64 differs between the two alphabets"
    (folder / f"{split}_imgs.tsv").write_text(tsv)
    lines = [
        {"text_id": 40 + i, "text": f"手写的{classnames[label]}", "image_ids": [700 + i]}
        for i, (_, label, _) in enumerate(samples)
    ]
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    (folder / f"{split}_texts.jsonl").write_text(text, encoding="utf-8")


def test_the_muge_guide_runs_as_written(tmp_path, digits_root, one_process, monkeypatch):  # noqa: F811
    import tiny_dual_encoders
    from transformers import AutoModel

    from mmpt.commands.export import main as export
    from mmpt.commands.make_image_text_shards import main as make_shards
    from mmpt.commands.zeroshot import main as zeroshot
    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.eval.zeroshot import load_classification_set

    data = load_classification_set(digits_root / "zeroshot", "zh")
    samples = list(data.samples())
    (tmp_path / "MUGE").mkdir()
    muge_split(tmp_path / "MUGE", "train", samples[:40], data.classnames)
    muge_split(tmp_path / "MUGE", "valid", samples[40:52], data.classnames)
    checkpoint = tiny_dual_encoders.build("chinese_clip", tmp_path / "chinese-clip")
    monkeypatch.chdir(tmp_path)
    steps = commands()
    assert [c[0] for c in steps] == ["mmpt-make-image-text-shards", "deepspeed", "mmpt-zeroshot", "mmpt-export"]
    convert, launch, evaluate, release = steps

    assert make_shards([*convert[1:], "--processes", "1"]) == 0
    config, overrides = launch[launch.index("--config") + 1], launch[launch.index("--config") + 2 :]
    overrides = [o.replace(HUB_NAME, str(checkpoint)) for o in overrides]
    train(load_config(config, [*overrides, *SHRINK]))
    records = [json.loads(line) for line in (tmp_path / "runs/muge/metrics.jsonl").read_text().splitlines()]
    assert any("train/i2t_acc" in r for r in records) and "eval/valid_texts/zh/mean_recall" in records[-1]

    assert zeroshot(evaluate[1:]) == 0
    predictions = [
        json.loads(line) for line in (tmp_path / "runs/muge/valid_predictions.jsonl").read_text().splitlines()
    ]
    assert [p["text_id"] for p in predictions] == list(range(40, 52)) and all(
        len(p["image_ids"]) == 10 for p in predictions
    )

    assert export(release[1:]) == 0
    loaded = AutoModel.from_pretrained(tmp_path / "releases/muge-chinese-clip")
    assert type(loaded).__name__ == "ChineseCLIPModel"
    assert not torch.equal(loaded.text_projection.weight, AutoModel.from_pretrained(checkpoint).text_projection.weight)

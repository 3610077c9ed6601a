"""The bilingual img2dataset journey: shards with English and Chinese captions in their json, two sources
reading different json fields, the M²-Encoder demo config trained on 2 ranks and evaluated."""

import json
from pathlib import Path

import pytest
from img2dataset_shards import write_set, write_shard

from conftest import REPO, _deep_update, read_metrics, tiny_m2_arch
from mmpt.config import read_config
from pool import scenario

SHRINK = {  # the M²-Encoder demo config at test size (as the config matrix shrinks it)
    "method": {
        "tokenizer": None,
        "arch": tiny_m2_arch(image_size=32, text_positions=32, context_length=24),
        "loss": {"name": "gba_itc", "group_size": "world", "accumulation_steps": 2, "tile_size": 6},
        "augment": {"crop_scale": [0.8, 1.0], "hflip": False, "randaugment": False},
    },
    "train": {"max_steps": 4, "save_every": 2, "log_every": 1, "keep_last": 2, "grad_accum": 2},
    "optim": {"warmup_steps": 1},
}


def your_data_config(folder: Path, digits_root: Path, zero_stage: int) -> dict:
    pattern = write_set(folder / "web", shards=4, per_shard=24)
    data, _, _ = read_config(REPO / "configs/m2_encoder/demo.yaml")
    cfg = _deep_update(data, SHRINK)
    cfg["extends"] = []
    cfg["method"]["tokenizer"] = str(digits_root / "tokenizer.json")
    cfg["method"]["eval_batch_size"] = 64
    cfg["data"] = {
        "train": {
            "sources": [
                {"shards": pattern, "name": "en", "caption_key": "json.caption"},
                {"shards": pattern, "name": "zh", "caption_key": "json.caption_zh", "weight": 0.5},
            ],
            "batch_size": 4,
            "num_workers": 1,
            "shuffle_buffer": 20,
        }
    }
    cfg["data"]["eval"] = [
        {
            "dataset": str(digits_root / "zeroshot"),
            "task": "zeroshot_classification",
            "name": "digits",
            "languages": ["en", "zh"],
        },
        {
            "dataset": str(digits_root / "zeroshot/retrieval_zh.jsonl"),
            "task": "zeroshot_retrieval",
            "name": "digits_retrieval",
            "languages": ["zh"],
        },
        {
            "dataset": str(write_shard(folder / "heldout", 0, 20, start=1000)),
            "task": "zeroshot_retrieval",
            "name": "heldout_zh",
            "caption_key": "json.caption_zh",
            "languages": ["zh"],
        },
    ]
    cfg["train"].update(zero_stage=zero_stage, eval_every=2)
    cfg["run"] = {"progress_bar": False, "tensorboard": False}
    return cfg


def your_data_scenario(zero_stage: int) -> str:
    @scenario(f"your-data-zero{zero_stage}")
    def build(corpora, run_dir):
        folder = run_dir.parent / f"your-data-zero{zero_stage}-shards"
        return your_data_config(folder, corpora["digits"], zero_stage), [], "train"

    return f"your-data-zero{zero_stage}"


SCENARIOS = {stage: your_data_scenario(stage) for stage in (2, 3)}


@pytest.mark.parametrize("zero_stage", [pytest.param(s, marks=pytest.mark.pool(n)) for s, n in SCENARIOS.items()])
def test_bilingual_img2dataset_shards_train_the_m2_encoder_from_two_json_fields(rank_pool, zero_stage):
    run_dir = rank_pool.run_dir(SCENARIOS[zero_stage])
    output = "\n".join(rank_pool.record(SCENARIOS[zero_stage])["said"])
    assert "caption_key=json.caption_zh" in output and "source 'en': 4 shard(s), 96 samples" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    for source in ("en", "zh"):
        counts = summary["data"][source]
        assert counts["decoded"] > 0 and counts["skipped"] == 0, (source, counts)
    assert summary["data"]["en"]["decoded"] > summary["data"]["zh"]["decoded"]  # weights 1 : 0.5
    final = read_metrics(run_dir)[-1]  # the evaluation at the end
    for language in ("en", "zh"):
        assert 0 <= final[f"eval/digits/{language}/acc1"] <= 1
    evaluated = {r["step"]: r for r in read_metrics(run_dir) if "eval/digits/seconds" in r}
    assert set(evaluated) == {2, 4}  # every eval_every steps, and at the end
    for record in evaluated.values():
        assert {
            "eval/digits/en/acc1",
            "eval/digits/zh/acc1",
            "eval/digits_retrieval/zh/image_retrieval_recall@1",
            "eval/digits_retrieval/seconds",
            "eval/heldout_zh/zh/mean_recall",
        } <= set(record)
    assert "eval step 2 digits/en/acc1=" in output

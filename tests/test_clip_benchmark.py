"""CLIP_benchmark's own CLI on an mmpt run gives the numbers `launch/zeroshot.py` gives (fp32)."""

import io
import json
import sys

import pytest
from PIL import Image

from conftest import run_command, run_tool, tiny_config, write_config
from mmpt.data import ShardSetWriter


@pytest.fixture(scope="module")
def tiny_run(module_tmp, digits_root):
    folder = module_tmp("cb_run")
    config = write_config(
        folder / "cfg.yaml", tiny_config(digits_root, folder / "run", train={"max_steps": 3, "save_every": 0})
    )
    run_tool("train", "--config", str(config))
    return folder / "run"


def retrieval_folder(source, folder, images=60):
    """CLIP_benchmark's retrieval layout: dataset_type.txt, test/{0,1}.tar of png + txt (a caption per line).
    Every caption is distinct (it names its scan), so no two scores tie and both conventions rank alike."""
    (folder / "test").mkdir(parents=True)
    (folder / "dataset_type.txt").write_text("retrieval\n")
    (folder / "test" / "nshards.txt").write_text("2")
    records = [json.loads(line) for line in (source / "retrieval_en.jsonl").read_text().splitlines()][:images]
    for shard in range(2):
        with ShardSetWriter(folder / "test" / "part", max_samples=images) as writer:
            for i, record in enumerate(records[shard::2]):
                image = Image.open(source / record["image"]).convert("RGB")
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                number = 2 * i + shard
                captions = "\n".join(f"{caption} (scan {number}, {k})" for k, caption in enumerate(record["caption"]))
                writer.write({"__key__": f"{number:05d}", "png": buffer.getvalue(), "txt": captions})
        (folder / "test" / "part-000000.tar").rename(folder / "test" / f"{shard}.tar")
    return folder


def clip_benchmark(run, dataset_root, task, out, *extra):
    run_command(
        [
            sys.executable,
            "-m",
            "mmpt.clip_benchmark",
            "eval",
            "--model_type",
            "mmpt",
            "--model",
            "tiny",
            "--pretrained",
            str(run),
            "--dataset",
            "wds/digits",
            "--dataset_root",
            str(dataset_root),
            "--task",
            task,
            "--no_amp",
            "--batch_size",
            "50",
            "--output",
            str(out),
            *extra,
        ]
    )
    return json.loads(out.read_text())["metrics"]


def ours(run, dataset, task, out):
    args = ["--model", str(run), "--dataset", str(dataset), "--task", task, "--output", str(out)]
    run_tool("zeroshot", *args, "--device", "cpu")
    return json.loads(out.read_text())["metrics"]


@pytest.mark.distributed  # starts subprocesses
def test_clip_benchmark_cli_reports_what_zeroshot_reports(tmp_path, digits_root, tiny_run):
    source = digits_root / "zeroshot"  # the demo's held-out split, already in CLIP_benchmark's layout
    folder = source
    theirs = clip_benchmark(tiny_run, folder, "zeroshot_classification", tmp_path / "cb_cls.json")
    mine = ours(tiny_run, folder, "zeroshot_classification", tmp_path / "cls.json")
    assert set(mine) == {"acc1", "acc5", "mean_per_class_recall"}
    for key, value in mine.items():
        assert theirs[key] == pytest.approx(value, abs=1e-6), key
    assert 0 < mine["acc5"] < 1  # a 3-step model: the comparison is not between two perfect scores

    folder = retrieval_folder(source, tmp_path / "digits_ret")
    theirs = clip_benchmark(
        tiny_run, folder, "zeroshot_retrieval", tmp_path / "cb_ret.json", "--recall_k", "1", "5", "10"
    )
    mine = ours(tiny_run, folder, "zeroshot_retrieval", tmp_path / "ret.json")
    for key in (f"{way}_retrieval_recall@{k}" for way in ("image", "text") for k in (1, 5, 10)):
        assert theirs[key] == pytest.approx(mine[key], abs=1e-6), key
    assert 0 < mine["image_retrieval_recall@10"] < 1

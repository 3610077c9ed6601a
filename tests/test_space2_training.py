"""The SPACE-2 demo config end to end, shortened: 2 CPU ranks, ZeRO-3 (tied MLM decoder), per-source batches, intent
evaluation."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port, launcher_env, read_metrics

pytestmark = pytest.mark.distributed


def test_space2_demo_config_trains_and_evaluates(tmp_path):
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    overrides = [
        "run.progress_bar=false",
        "train.max_steps=6",
        "train.log_every=1",
        "train.save_every=3",
        "data.train.batch_size=8",
        "train.zero_stage=3",
        "method.intent_eval.seeds=1",
        "method.intent_eval.full=false",
    ]
    command = [
        launcher,
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(REPO / "launch/train.py"),
        "--config",
        str(REPO / "configs/space2/demo.yaml"),
        *overrides,
    ]
    # relative paths: run from an empty directory, which builds its own corpus and shards
    result = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run = tmp_path / "runs/space2-demo"
    records = [r for r in read_metrics(run) if "loss/total" in r]
    assert [r["step"] for r in records] == list(range(1, 7))
    for name in ("labelled/contrastive", "labelled/mlm", "unlabelled/contrastive", "unlabelled/mlm"):
        assert all(math.isfinite(r[f"loss/{name}"]) and r[f"loss/{name}"] > 0 for r in records), name
    assert records[-1]["data/seen"] == 6 * 8 * 2 and records[-1]["data/skipped"] == 0
    final = read_metrics(run)[-1]
    accuracy = final["intent/10shot/accuracy_mean"]
    assert 1 / 31 < accuracy <= 1

    # the evaluation entry point on the saved run reproduces the end-of-training number
    out = tmp_path / "intent.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/intent_eval.py"),
            "--model",
            str(run),
            "--dataset",
            "dialogs",
            "--seeds",
            "1",
            "--no-full",
            "--output",
            str(out),
        ],
        cwd=tmp_path,
        env=launcher_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert json.loads(out.read_text())["metrics"]["10shot/accuracy_mean"] == pytest.approx(accuracy, abs=1e-9)

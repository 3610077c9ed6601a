"""The README's demo, as a new user runs it: 2 CPU ranks, ZeRO-2, zero-shot >= 0.80 in both languages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port, launcher_env, read_metrics

pytestmark = pytest.mark.distributed


def test_demo_trains_and_zeroshot_cli_reproduces(tmp_path):
    # The demo's paths are relative: run from an empty directory so it builds its own corpus there.
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    command = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "launch/train.py"),
               "--config", str(REPO / "configs/clip/demo.yaml"), "run.progress_bar=false"]
    result = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "runs/clip-demo"
    final = read_metrics(run_dir)[-1]
    for language in ("en", "zh"):
        assert final[f"zeroshot/{language}/acc1"] >= 0.80, final
        out = tmp_path / f"{language}.json"
        subprocess.run([sys.executable, str(REPO / "launch/zeroshot.py"), "--model", "runs/clip-demo", "--dataset", "digits",
                        "--task", "zeroshot_classification", "--language", language, "--output", str(out)],
                       cwd=tmp_path, env=launcher_env(), check=True, capture_output=True, timeout=300)
        record = json.loads(out.read_text())
        assert record["dataset"] == "digits" and record["language"] == language
        assert record["metrics"]["acc1"] == pytest.approx(final[f"zeroshot/{language}/acc1"], abs=1e-6)
        assert record["metrics"]["mean_per_class_recall"] == pytest.approx(
            final[f"zeroshot/{language}/mean_per_class_recall"], abs=1e-6)

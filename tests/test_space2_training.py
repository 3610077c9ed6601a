"""The SPACE-2 demo config end to end, shortened: 2 CPU ranks, ZeRO-3 (tied MLM decoder), per-source batches, intent
evaluation."""

import json
import math

import pytest

from conftest import REPO, read_metrics, run_tool
from pool import scenario

pytestmark = pytest.mark.distributed


@scenario("space2-demo")
def space2_demo(corpora, run_dir):
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
    # relative paths: the pool's ranks run in an empty directory, where the demo builds its own corpus and shards
    return REPO / "configs/space2/demo.yaml", overrides, "train"


@pytest.mark.pool("space2-demo")
def test_space2_demo_config_trains_and_evaluates(rank_pool, tmp_path):
    run = rank_pool.run_dir("space2-demo")
    cwd = run.parent  # where the demo's relative paths point
    records = [r for r in read_metrics(run) if "loss/total" in r]
    assert [r["step"] for r in records] == list(range(1, 7))
    for name in ("labelled/contrastive", "labelled/mlm", "unlabelled/contrastive", "unlabelled/mlm"):
        assert all(math.isfinite(r[f"loss/{name}"]) and r[f"loss/{name}"] > 0 for r in records), name
    assert records[-1]["data/seen"] == 6 * 8 * 2 and records[-1]["data/skipped"] == 0
    final = read_metrics(run)[-1]
    accuracy = final["eval/dialogs/en/10shot/accuracy_mean"]
    assert 1 / 31 < accuracy <= 1

    # the evaluation entry point on the saved run reproduces the end-of-training number
    out = tmp_path / "intent.json"
    args = ["--model", str(run), "--dataset", "dialogs", "--seeds", "1", "--no-full", "--output", str(out)]
    run_tool("intent_eval", *args, cwd=cwd, timeout=300)
    assert json.loads(out.read_text())["metrics"]["10shot/accuracy_mean"] == pytest.approx(accuracy, abs=1e-9)

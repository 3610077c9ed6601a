"""Bytes each rank moves per optimizer step, by ZeRO stage and number of accumulated micro-batches K: which
stages reduce gradients once per step and which once per micro-batch.

Each variant trains the M²-Encoder demo (configs/m2_encoder/demo.yaml: GBA-ITC with pooled accumulation, fp32)
on 2 CPU ranks under the deepspeed launcher for 3 steps, logging every step. The engine's own collective
accounting (`mmpt.engine.resilience.collective_timing`, on with train.rank_health, written to metrics.jsonl as
`collectives/<kind>/mib_per_rank`)
gives rank 0's MiB per collective kind; steps 2-3 are averaged (step 1 includes start-up traffic). The model's
gradient (its trainable parameters x 4 bytes) is the unit: a stage that reduces once per step moves about
2 x it through all-reduce (ring: twice the buffer), whatever K is; one that reduces per micro-batch, K times
that. What carries over to GPUs is the count, not the time: NCCL moves the same buffers.

    python benchmarks/accumulation_bytes.py        # about 8 minutes on 2 idle cores (demo data under demo_data/)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "m2_encoder" / "demo.yaml"
STAGES = (0, 1, 2, 3)
ACCUMULATIONS = (1, 4)


def run(stage: int, accum: int, work: Path) -> dict[str, float]:
    """Rank 0's MiB per step by collective kind over steps 2-3 of a 3-step run."""
    run_dir = work / f"zero{stage}-k{accum}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_gpus",
        "2",
        "--master_port",
        str(29600 + 10 * stage + accum),
        str(REPO / "launch" / "train.py"),
        "--config",
        str(CONFIG),
        f"run.output_dir={run_dir}",
        f"train.zero_stage={stage}",
        f"train.grad_accum={accum}",
        "method.loss.accumulation_steps=null",  # follows train.grad_accum
        "train.max_steps=3",
        "train.log_every=1",
        "train.rank_health=true",
        "train.save_every=0",
        "train.eval_every=0",
        "data.train.batch_size=8",
        "data.eval=[]",
        "run.progress_bar=false",
        "run.tensorboard=false",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise SystemExit(f"zero{stage} K={accum} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") in (2, 3) and any(k.startswith("collectives/") for k in r)]
    assert len(steps) == 2, f"zero{stage} K={accum}: no collective records for steps 2-3"
    kinds = {k.split("/")[1] for r in steps for k in r if k.startswith("collectives/") and k.endswith("/mib_per_rank")}
    return {kind: sum(r.get(f"collectives/{kind}/mib_per_rank", [0.0])[0] for r in steps) / 2 for kind in kinds}


def gradient_mib() -> float:
    from mmpt.config_loader import load_config
    from mmpt.plan.build import built, count

    with built(load_config(CONFIG, ["method.loss.accumulation_steps=null"])) as b:
        return count(b).trainable * 4 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    from mmpt import demo

    demo.build("digits", REPO / "demo_data")
    unit = gradient_mib()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmpt-bytes-") as scratch:
        for stage in STAGES:
            for accum in ACCUMULATIONS:
                per_kind = run(stage, accum, Path(scratch))
                rows.append({"zero_stage": stage, "grad_accum": accum, "mib_per_step": per_kind})
                print(json.dumps(rows[-1]), flush=True)
    write(rows, unit, args.out)


def write(rows: list[dict], unit: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "config": str(CONFIG.relative_to(REPO)), "gradient_mib": unit}
    (out / "accumulation_bytes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    kinds = sorted({kind for r in rows for kind in r["mib_per_step"]})
    lines = [
        "# Bytes per rank per step by ZeRO stage and accumulated micro-batches",
        "",
        f"{meta['date']}, 2 CPU ranks (gloo), `{meta['config']}` (GBA-ITC, fp32), per-rank micro-batch 8; rank 0's "
        f"MiB per optimizer step (steps 2-3), by collective kind, from the engine's collective accounting. "
        f"Gradient: {unit:.1f} MiB. Produced by `benchmarks/accumulation_bytes.py`.",
        "",
        "| ZeRO stage | K | " + " | ".join(f"{k} MiB" for k in kinds) + " | total MiB | x gradient |",
        "|---|---|" + "---|" * len(kinds) + "---|---|",
    ]
    for r in rows:
        values = [r["mib_per_step"].get(k, 0.0) for k in kinds]
        total = sum(values)
        lines.append(
            f"| {r['zero_stage']} | {r['grad_accum']} | "
            + " | ".join(f"{v:.1f}" for v in values)
            + f" | {total:.1f} | {total / unit:.2f} |"
        )
    (out / "accumulation_bytes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

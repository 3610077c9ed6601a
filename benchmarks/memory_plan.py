"""The planner's predictions against measurement: the working bytes of one micro-batch, predicted from fake
tensors (two batch sizes, a line through them) against the same step run on real CPU tensors at another
batch size, with and without gradient checkpointing.

    python benchmarks/memory_plan.py        # writes benchmarks/results/memory_plan.{md,json}
"""

from __future__ import annotations

import json
from pathlib import Path

from mmpt.config_loader import load_config
from mmpt.engine.precision import DTYPES
from mmpt.plan.build import built
from mmpt.plan.measure import measure_step, set_checkpointing
from mmpt.plan.profile import profile

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("configs/m2_encoder/demo.yaml", [], 16),
    ("configs/m2_encoder/demo.yaml", ["method.arch.grad_checkpointing=true"], 16),
    ("configs/m2_encoder/0.4b.yaml", ["method.arch.lower_layers=2", "method.arch.shared_layers=1"], 3),
    (
        "configs/m2_encoder/0.4b.yaml",
        ["method.arch.lower_layers=2", "method.arch.shared_layers=1", "method.arch.grad_checkpointing=true"],
        3,
    ),
    ("configs/clip/demo.yaml", [], 16),
]


def measured(config: str, overrides: list[str], batch: int) -> int:
    """Peak working bytes of one real micro-batch on CPU."""
    cfg = load_config(ROOT / config, overrides)
    with built(cfg, device="cpu") as b:  # real weights, initialised as training initialises them
        b.model.to(DTYPES[cfg.train.precision])
        set_checkpointing(b.model, bool(getattr(getattr(cfg.method, "arch", None), "grad_checkpointing", False)))
        return measure_step(b, batch).peak_bytes


def main() -> None:
    rows = []
    for config, overrides, batch in CASES:
        cfg = load_config(ROOT / config, overrides)
        predicted = profile(cfg).activations.at(batch)
        real = measured(config, overrides, batch)
        rows.append(
            {
                "config": config,
                "overrides": overrides,
                "micro_batch": batch,
                "predicted_bytes": int(predicted),
                "measured_bytes": real,
                "error": predicted / real - 1,
            }
        )
        print(rows[-1], flush=True)
    out = ROOT / "benchmarks/results"
    (out / "memory_plan.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "# Planner against measurement: working bytes of one micro-batch",
        "",
        "Predicted: `mmpt.plan.profile` (fake tensors at two other batch sizes, a line through them). Measured: the",
        "same training step on real CPU tensors (the model built and initialised as training builds it), live storages tracked until freed.",
        "",
        "| config | overrides | micro-batch | predicted MB | measured MB | error |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['config']} | {' '.join(r['overrides']) or '-'} | {r['micro_batch']} | "
            f"{r['predicted_bytes'] / 1e6:.1f} | {r['measured_bytes'] / 1e6:.1f} | {r['error']:+.1%} |"
            for r in rows
        ),
        "",
    ]
    (out / "memory_plan.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

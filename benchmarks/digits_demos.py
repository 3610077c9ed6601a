"""The clip and M²-Encoder digits demos with and without random placement, as a new user runs them.

Each demo config is trained twice in a fresh directory on 2 CPU ranks (the deepspeed launcher):
as configured (random scale 0.6-1.4 and shift up to 15% of the frame in training), and with that
placement off (`method.augment.affine_scale=null method.augment.affine_translate=0`), the recipe
before it. Both are scored zero-shot at the end of training, in English and Chinese, on

- `digits`: the 359 held-out scans, rendered as in training, with the held-out prompt templates;
- `digits_unseen`: the same scans drawn at 0.65-1.35x the frame and moved up to 4 px, with prompt
  wordings that neither the captions nor the `digits` templates use.

`distill`: a smaller clip student (half the embedding, a one-layer text tower, a fifth of the steps) trained
alone and distilled (`method.distill`, weight 1, temperatures 1 and 3) from the clip demo as configured,
trained first as its teacher.

Wall time is the launcher's: corpus build, training, both evaluations. Results:
benchmarks/results/digits_demos.{json,md}.

    python benchmarks/digits_demos.py                      # ~25 minutes on 2 cores
    python benchmarks/digits_demos.py --demo m2_encoder    # one demo; the other's committed rows are kept
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import RESULTS, machine_line, save_results, train_demo

CLIP = "configs/clip/demo.yaml"
DEMOS = {
    "clip": (CLIP, "runs/clip-demo"),
    "m2_encoder": ("configs/m2_encoder/demo.yaml", "runs/m2-encoder-demo"),
    "distill": (CLIP, ""),  # its runs are named below
}
VARIANTS = {
    "random placement (as configured)": [],
    "no placement": ["method.augment.affine_scale=null", "method.augment.affine_translate=0"],
}
SMALL_STUDENT = ["method.embed_dim=32", "method.text.width=48", "method.text.layers=1", "method.text.heads=2"]
SMALL_STUDENT += ["train.max_steps=50"]
SETS = {"digits": "eval/digits", "digits_unseen": "eval/digits_unseen"}


def variants(demo: str, run: str) -> list[tuple[str, list[str], str]]:
    """(name, overrides, run directory) of each training of `demo`."""
    if demo != "distill":
        return [(name, overrides, run) for name, overrides in VARIANTS.items()]
    teacher = str(Path(tempfile.mkdtemp(prefix="digits-teacher-")))
    student = str(Path(tempfile.mkdtemp(prefix="digits-student-")))
    return [
        ("teacher: the clip demo as configured", [f"run.output_dir={teacher}"], teacher),
        ("small student alone", [*SMALL_STUDENT, f"run.output_dir={student}/alone"], f"{student}/alone"),
    ] + [
        (
            f"small student distilled from the teacher, temperature {t}",
            [
                *SMALL_STUDENT,
                f"method.distill={{teacher: {teacher}, temperature: {t}}}",
                f"run.output_dir={student}/{t}",
            ],
            f"{student}/{t}",
        )
        for t in (1, 3)
    ]


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMOS), action="append", help="only these demos (default: all)")
    chosen = parser.parse_args().demo or list(DEMOS)
    committed = RESULTS / "digits_demos.json"
    kept = json.loads(committed.read_text())["rows"] if committed.exists() else []
    rows = [row for row in kept if row["demo"] not in chosen]
    for demo in chosen:
        config, demo_run = DEMOS[demo]
        for variant, overrides, run in variants(demo, demo_run):
            seconds, records = train_demo(config, run, overrides)
            final = records[-1]
            rows.append(
                {
                    "demo": demo,
                    "variant": variant,
                    "seconds": seconds,
                    "acc1": {
                        f"{name}/{language}": final[f"{prefix}/{language}/acc1"]
                        for name, prefix in SETS.items()
                        for language in ("en", "zh")
                    },
                }
            )
            print(rows[-1], flush=True)
    machine = machine_line("2 CPU ranks (gloo), ZeRO-2, fp32")
    rows.sort(key=lambda row: list(DEMOS).index(row["demo"]))
    lines = [
        f"{machine}. Zero-shot top-1 on 359 held-out scans (chance 0.10). Produced by `benchmarks/digits_demos.py`.",
        "",
        "| demo | training | digits EN | digits ZH | digits_unseen EN | digits_unseen ZH | wall time (min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        acc = row["acc1"]
        lines.append(
            f"| {row['demo']} | {row['variant']} | {acc['digits/en']:.3f} | {acc['digits/zh']:.3f} | "
            f"{acc['digits_unseen/en']:.3f} | {acc['digits_unseen/zh']:.3f} | {row['seconds'] / 60:.1f} |"
        )
    save_results("digits_demos", {"machine": machine, "variants": VARIANTS, "rows": rows}, lines)


if __name__ == "__main__":
    main()

"""The clip and M²-Encoder digits demos with and without random placement, as a new user runs them.

Each demo config is trained twice in a fresh directory on 2 CPU ranks (the deepspeed launcher):
as configured (random scale 0.6-1.4 and shift up to 15% of the frame in training), and with that
placement off (`method.augment.affine_scale=null method.augment.affine_translate=0`), the recipe
before it. Both are scored zero-shot at the end of training, in English and Chinese, on

- `digits`: the 359 held-out scans, rendered as in training, with the held-out prompt templates;
- `digits_unseen`: the same scans drawn at 0.65-1.35x the frame and moved up to 4 px, with prompt
  wordings that neither the captions nor the `digits` templates use.

Wall time is the launcher's: corpus build, training, both evaluations. Results:
benchmarks/results/digits_demos.{json,md}.

    python benchmarks/digits_demos.py                      # ~17 minutes on 2 cores
    python benchmarks/digits_demos.py --demo m2_encoder    # one demo; the other's committed rows are kept
"""

from __future__ import annotations

import argparse
import json

from common import RESULTS, demo_machine, save_results, train_demo

DEMOS = {
    "clip": ("configs/clip/demo.yaml", "runs/clip-demo"),
    "m2_encoder": ("configs/m2_encoder/demo.yaml", "runs/m2-encoder-demo"),
}
VARIANTS = {
    "random placement (as configured)": [],
    "no placement": ["method.augment.affine_scale=null", "method.augment.affine_translate=0"],
}
SETS = {"digits": "eval/digits", "digits_unseen": "eval/digits_unseen"}


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", choices=sorted(DEMOS), action="append", help="only these demos (default: all)")
    chosen = parser.parse_args().demo or list(DEMOS)
    committed = RESULTS / "digits_demos.json"
    kept = json.loads(committed.read_text())["rows"] if committed.exists() else []
    rows = [row for row in kept if row["demo"] not in chosen]
    for demo in chosen:
        config, run = DEMOS[demo]
        for variant, overrides in VARIANTS.items():
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
    machine = demo_machine()
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

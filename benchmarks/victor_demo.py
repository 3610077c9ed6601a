"""The VICTOR moving-digits demo and its dual-VSA ablation, as a new user runs them.

Each variant trains `configs/victor/demo.yaml` with the deepspeed launcher on 2 CPU ranks in a fresh
directory (which builds the corpus), then reads the end-of-training retrieval on the 170 held-out
clips (English and Chinese captions, every text ranks all clips; chance R@1 = 1/170):

- `all tasks`: the demo as configured;
- `no dual-VSA`: `method.tasks.dual_vsa=0`, everything else the same.

Wall time is the launcher's, corpus build and evaluation included. Results:
benchmarks/results/victor_demo.{json,md}.

    python benchmarks/victor_demo.py          # ~16 minutes on 2 cores
"""

from __future__ import annotations

from common import machine_line, save_results, train_demo

VARIANTS = {"all tasks": [], "no dual-VSA": ["method.tasks.dual_vsa=0"]}
CLIPS = 170


def train(overrides: list[str]) -> dict:
    seconds, records = train_demo("configs/victor/demo.yaml", "runs/victor-demo", overrides)
    losses = [r for r in records if "loss/total" in r]
    return {
        "seconds": seconds,
        "final": records[-1],
        "last_losses": {k: v for k, v in losses[-1].items() if k.startswith("loss/")},
    }


def main() -> None:

    rows = {name: train(overrides) for name, overrides in VARIANTS.items()}
    machine = machine_line("2 CPU ranks (gloo), ZeRO-2, fp32")
    lines = [
        f"{machine}. `configs/victor/demo.yaml`, {CLIPS} held-out clips (chance R@1 = {100 / CLIPS:.2f}%). "
        "Produced by `benchmarks/victor_demo.py`.",
        "",
        "| variant | captions | T2V R@1 | R@5 | R@10 | MdR | MnR | V2T R@1 | R@5 | R@10 | MdR | wall time (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        for language in ("en", "zh"):
            m = {
                k.split("/", 3)[3]: v
                for k, v in row["final"].items()
                if k.startswith(f"eval/moving_digits/{language}/")
            }
            lines.append(
                f"| {name} | {language} | {100 * m['video_retrieval_recall@1']:.1f} | {100 * m['video_retrieval_recall@5']:.1f} | "
                f"{100 * m['video_retrieval_recall@10']:.1f} | {m['video_retrieval_median_rank']:.0f} | "
                f"{m['video_retrieval_mean_rank']:.1f} | {100 * m['text_retrieval_recall@1']:.1f} | "
                f"{100 * m['text_retrieval_recall@5']:.1f} | {100 * m['text_retrieval_recall@10']:.1f} | "
                f"{m['text_retrieval_median_rank']:.0f} | {row['seconds'] / 60:.1f} |"
            )
    lines += ["", "Loss terms at the last step:", ""]
    for name, row in rows.items():
        lines.append(f"- {name}: " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in row["last_losses"].items()))
    save_results("victor_demo", {"machine": machine, "variants": VARIANTS, "rows": rows}, lines)


if __name__ == "__main__":
    main()

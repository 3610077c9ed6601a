"""The planner's predictions against what the GPU suite measured: per-GPU memory (model states, activations,
logits and the input batch) against `torch.cuda.max_memory_allocated`, and the predicted step time at the
planner's assumed MFU against the measured step.

    python benchmarks/gpu/planner_check.py [RESULTS]     # default benchmarks/results/gpu -> planner.md, planner.json

Runs here, on CPU: the planner works on the meta device and fake tensors. Each measured mmpt run's config is
made again by the suite's own functions (`stages.py`), its corpora built here by the same builders the suite
ran on the GPU machine (the tokenizers fix the vocabulary sizes), at the batch, ZeRO stage and accumulation
the run had, and planned for one GPU of the kind the suite ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import corpora
import results
import stages
from training import benchmark_settings, deep_update

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
# What a reader needs to read a row right, by the start of its run's name.
NOTES = {
    "SPACE-2": "SPACE-2: the planner holds every dialog at the config's `max_len` (256 tokens), the longest a batch "
    "may bring; the suite's generated dialogs are far shorter, and a batch is padded to its longest dialog only. "
    "Its memory and FLOPs are a bound here, not a prediction; the implied MFU is meaningless for the same reason.",
}


def measured_runs(stage_records: dict[str, dict], data: Path) -> list[tuple[str, dict, dict]]:
    """(name, config, measured run record) of every mmpt run with a peak on record, configs made as the suite
    made them (data under `data`)."""
    p = stages.GPU
    digits = data / "digits"
    found: list[tuple[str, dict, dict]] = []

    def results_of(name: str) -> dict:
        record = stage_records.get(name) or {}
        return record.get("results") or {}

    for run in results_of("clip_vitb16").get("runs", []):
        if run.get("trainer") == "mmpt" and run.get("peak_allocated_mib"):
            found.append(
                (f"ViT-B/16 CLIP, ZeRO-{run['zero_stage']}", stages.clip_config(p, digits, run["zero_stage"]), run)
            )
    for setting in results_of("m2_encoder").get("settings", []):
        run = setting.get("throughput")
        if run and run.get("peak_allocated_mib"):
            zero, accum, batch = (
                setting["zero_stage"],
                setting["grad_accum"],
                run["global_batch"] // setting["grad_accum"],
            )
            config = stages.m2_config(p, digits, batch, zero, accum, search=False)
            found.append((f"M²-Encoder 0.4B, ZeRO-{zero}, grad_accum {accum}", config, run))
    methods = {
        "space2": lambda: stages.space2_config(p, data / "dialogs", data / "bert-base"),
        "victor": lambda: stages.victor_config(p, data / "moving_digits", results_of("victor").get("video_backend")),
    }
    for name, make in methods.items():
        run = results_of(name).get("run")
        if run and run.get("peak_allocated_mib"):
            config = deep_update(make(), {"data": {"train": {"batch_size": results_of(name)["batch"]}}})
            found.append((f"{'SPACE-2' if name == 'space2' else 'VICTOR'} base", config, run))
    return found


def build_corpora(data: Path, names: set[str]) -> None:
    """What the configs read to be planned: the tokenizers (digits, moving digits) and the BERT encoder's config."""
    if {"clip_vitb16", "m2_encoder"} & names:
        corpora.digits(data, dry_run=False)
    if "victor" in names:
        corpora.moving_digits(data, dry_run=False)
    if "space2" in names:
        corpora.bert_checkpoint(data / "bert-base", corpora.dialogs(data), dry_run=False)


def plan_one(config: dict, gpu_name: str, work: Path) -> dict[str, Any]:
    import yaml

    from mmpt.config_loader import load_config
    from mmpt.plan.hardware import GPUS, Assumptions
    from mmpt.plan.planner import Cluster, make_plan
    from mmpt.plan.profile import profile

    path = work / "config.yaml"
    config = deep_update(config, benchmark_settings(work / "run", stages.GPU.steps))  # as the run had them
    path.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False))
    cfg = load_config(path)
    gpu = GPUS["h200" if "H200" in gpu_name else "h100"]
    assume = Assumptions()
    plan = make_plan(cfg, profile(cfg), Cluster(1, 1, gpu, gpu.memory_gib), assume)
    return {
        "gpu": gpu.name,
        "states_bytes": plan.states.gpu,
        "activations_bytes": plan.activations,
        "logits_bytes": plan.logits,
        "batch_bytes": plan.batch,
        "gpu_bytes": plan.gpu_bytes,
        "largest_micro_batch": plan.largest_micro_batch,
        "step_s": plan.step_s,
        "assumed_mfu": assume.mfu,
    }


def compare(stage_records: dict[str, dict], data: Path) -> dict[str, Any]:
    environment = next((s["environment"] for s in stage_records.values() if s.get("environment")), {})
    gpu_name = results.gpu_name(environment)
    build_corpora(data, set(stage_records))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, config, run in measured_runs(stage_records, data):
            started = time.monotonic()
            planned = plan_one(config, gpu_name, Path(work))
            measured_bytes = run["peak_allocated_mib"] * 2**20
            rows.append(
                {
                    "run": name,
                    "measured_name": run["name"],
                    "global_batch": run["global_batch"],
                    "measured_peak_bytes": measured_bytes,
                    "measured_step_s": run.get("step_s"),
                    "planned": planned,
                    "memory_error": planned["gpu_bytes"] / measured_bytes - 1,
                    "step_error": planned["step_s"] / run["step_s"] - 1 if run.get("step_s") else None,
                    "planning_s": time.monotonic() - started,
                }
            )
            print(f"{name}: planned {planned['gpu_bytes'] / 2**30:.2f} GiB, measured {measured_bytes / 2**30:.2f} GiB")
    return {"gpu": gpu_name, "environment": environment, "rows": rows}


def markdown(record: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        "# The planner against the GPU",
        "",
        f"Measured on {record['gpu']} by the GPU suite (`gpu.md` beside this file); planned here by "
        "`python benchmarks/gpu/planner_check.py` for one GPU of that kind, with each run's config, batch, ZeRO "
        "stage and accumulation. Memory: the planner's per-GPU bytes (model states + activations + logits + "
        "input batch) against `torch.cuda.max_memory_allocated` of the run. Step: the planner's predicted step "
        "at its assumed MFU against the measured median step. Error = planned / measured - 1.",
        "",
        "| run | global batch | planned GiB (states + activations + logits + batch) | measured peak GiB | memory error "
        "| planned step s (MFU) | measured step s | step error | MFU the measured step implies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        p = row["planned"]
        parts = " + ".join(
            f"{p[key] / gib:.2f}" for key in ("states_bytes", "activations_bytes", "logits_bytes", "batch_bytes")
        )
        step = f"{row['measured_step_s']:.3f}" if row["measured_step_s"] else "n/a"
        step_error = f"{row['step_error']:+.0%}" if row["step_error"] is not None else "n/a"
        # The planner's FLOPs at the measured step: the MFU its prediction would need to be exact.
        implied = f"{p['step_s'] * p['assumed_mfu'] / row['measured_step_s']:.0%}" if row["measured_step_s"] else "n/a"
        lines.append(
            f"| {row['run']} | {row['global_batch']} | {p['gpu_bytes'] / gib:.2f} ({parts}) | "
            f"{row['measured_peak_bytes'] / gib:.2f} | {row['memory_error']:+.0%} | {p['step_s']:.3f} "
            f"({p['assumed_mfu']:.0%}) | {step} | {step_error} | {implied} |"
        )
    notes = [NOTES[key] for key in NOTES if any(row["run"].startswith(key) for row in record["rows"])]
    return "\n".join([*lines, "", *notes]) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS, help="a folder of the suite's stage files")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mmpt-planner-check")
    args = parser.parse_args(argv)
    stage_records = results.read_stages(args.results)
    if not stage_records:
        print(f"no stage files in {args.results}", file=sys.stderr)
        return 2
    record = compare(stage_records, args.data)
    results.write_atomic(args.results / "planner.json", json.dumps(record, indent=1, default=str) + "\n")
    results.write_atomic(args.results / "planner.md", markdown(record))
    print(f"wrote {args.results / 'planner.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

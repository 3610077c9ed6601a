"""docs/planning.md's table: every shipped config on A100-80, H100-80 and H200-141 at 1, 2, 4 and 8 nodes of 8.

    python -m mmpt.plan.docs_table            # rewrites docs/planning.md (minutes: one fake-tensor step per config)

The page records a fingerprint of what it was made from (the configs and the planner's code); a test compares
it with the files as they are, so a stale page fails without the minutes a regeneration takes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from mmpt.config import ConfigError
from mmpt.config_loader import load_config
from mmpt.plan.hardware import GPUS, STEP_ERROR, Assumptions
from mmpt.plan.planner import Cluster, make_plan
from mmpt.plan.profile import profile

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/planning.md"
NODES = (1, 2, 4, 8)
PER_NODE = 8


def shipped_configs() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "base")


def fingerprint() -> str:
    digest = hashlib.sha256()
    for path in [*sorted((ROOT / "configs").rglob("*.yaml")), *sorted(Path(__file__).parent.glob("*.py"))]:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".yaml":  # comments say what the table says; they are not its input
            text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        digest.update(path.relative_to(ROOT).as_posix().encode() + text.encode())
    return digest.hexdigest()[:16]


def rows(config: Path, assume: Assumptions) -> list[str]:
    name = config.relative_to(ROOT).as_posix() + (" (demo)" if config.stem == "demo" else "")
    try:
        cfg = load_config(config)
        found = profile(cfg)
    except (ConfigError, RuntimeError) as exc:
        reason = re.sub(r"[^\s']*mmpt-plan-[^/\s']+", "<scratch run dir>", str(exc).splitlines()[0])  # no tmp path
        return [f"| {name} | - | - | not planned: {reason} | | | | | |"]
    out = []
    for gpu in GPUS.values():
        for nodes in NODES:
            plan = make_plan(cfg, found, Cluster(nodes * PER_NODE, PER_NODE, gpu, gpu.memory_gib), assume)
            out.append(
                f"| {name} | {gpu.name} | {nodes} | {'yes' if plan.fits else 'no'} | {plan.largest_micro_batch} | "
                f"{plan.states.gpu / 1e9:.1f} | {plan.activations / 1e9:.1f} | {plan.logits / 1e9:.2f} | "
                f"{plan.samples_per_s:,.0f} |"
            )
    return out


def render() -> str:
    assume = Assumptions()
    lines = [
        "# Planning a run",
        "",
        "`mmpt-plan --config C --gpus N [--gpus-per-node G] [--gpu a100|h100|h200] [--gpu-memory GiB] [--json]`",
        "(or `python launch/plan.py`) says what a config needs per GPU before any GPU is asked for: parameters,",
        "gradients, optimizer states by ZeRO stage (offload and hpZ included), momentum copies and memory queues,",
        "the activations of one micro-batch with and without gradient checkpointing, the contrastive logits at",
        "the real number of ranks, input and loader buffers, host memory per rank, the largest micro-batch that",
        "fits, FLOPs per sample, bytes each rank sends per step, and a predicted step time.",
        "",
        "Where the numbers come from: parameter counts from a meta-device build of the model through its method;",
        "activation bytes and FLOPs from one training micro-batch (step pool, training step, backward) run on",
        "fake tensors at full width and depth, live storages tracked until freed, at two batch sizes;",
        "model states in DeepSpeed's own layout (tests hold them to DeepSpeed's estimators). The measured bytes",
        "are checked against real CPU steps in `benchmarks/results/memory_plan.md`. A config that cannot fit one",
        "sample per GPU is refused in one line (exit code 2).",
        "",
        "Against one H100 (`benchmarks/results/gpu/planner.md`, each measured run's config planned again): the",
        "planned memory was 18% below to 4% above the measured peaks (the most below with gradient accumulation at",
        "ZeRO-2), so the usable share below leaves room for what it misses; the step times at the former 40% MFU",
        "were 2.1-3.5x too fast, and the MFU below is what the measured eager steps imply. At it the predicted",
        f"steps are {STEP_ERROR} off the measured ones (ViT-B/16 at ZeRO-0 and ZeRO-2, M²-Encoder 0.4B, VICTOR;",
        "SPACE-2's step is planned at its longest dialogs, a bound): every plan prints that beside its step time,",
        "and the samples/s below carry the same error. Both are options (`--usable-share`, `--mfu`): set them from",
        "your own runs.",
        "",
        "Assumptions of the table (each an option of the command but the loader's pinned batches):",
        "",
        *(f"- {line}" for line in assume.lines()),
        "",
        "| GPU | bf16 dense peak | fp32 peak | HBM | bandwidth |",
        "|---|---|---|---|---|",
        *(
            f"| {g.name} | {g.bf16_tflops:g} TFLOPS | {g.fp32_tflops:g} TFLOPS | {g.memory_gib:g} GB "
            f"| {g.hbm_tb_s:g} TB/s |"
            for g in GPUS.values()
        ),
        "",
        "Every shipped config as written (its micro-batch, ZeRO stage, precision), nodes of 8 GPUs. GB per GPU:",
        "model states; activations at the configured micro-batch; logits beyond one rank's.",
        "",
        "| config | GPU | nodes | fits | largest micro-batch | states GB | activations GB | logits GB | samples/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config in shipped_configs():
        lines.extend(rows(config, assume))
    lines += ["", f"Made by `python -m mmpt.plan.docs_table` from inputs with fingerprint `{fingerprint()}`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(render())

"""A plan as the text `mmpt-plan` prints, and as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mmpt.plan.hardware import GPUS, Assumptions, step_calibration
from mmpt.plan.planner import Plan
from mmpt.plan.profile import Profile

GB = 1e9


def gb(value: float) -> str:
    return f"{value / GB:.2f} GB"


def to_json(config: str, profile: Profile, plan: Plan, assume: Assumptions) -> dict[str, Any]:
    c = profile.counts
    return {
        "config": config,
        "cluster": {
            "gpus": plan.cluster.gpus,
            "gpus_per_node": plan.cluster.gpus_per_node,
            "nodes": plan.cluster.nodes,
            "gpu": plan.cluster.gpu.name,
            "memory_gib": plan.cluster.memory_gib,
        },
        "layout": asdict(plan.layout),
        "parameters": {"trainable": c.trainable, "frozen": c.frozen, "momentum_copies": c.momentum},
        "gpu_bytes_per_rank": {
            **asdict(plan.states),
            "activations": plan.activations,
            "activations_with_checkpointing_toggled": plan.activations_other,
            "gradient_checkpointing": profile.checkpointing,
            "merged_pool_pass": profile.merged,
            "contrastive_logits": plan.logits,
            "input_batch": plan.batch,
            "total": plan.gpu_bytes,
        },
        "host_bytes_per_rank": plan.host_per_rank,
        "host_bytes_while_building": {"rank 0": plan.build_host[0], "other ranks": plan.build_host[1]},
        "micro_batch": plan.micro_batch,
        "fits": plan.fits,
        "largest_micro_batch": plan.largest_micro_batch,
        "flops_per_sample": plan.flops_per_sample,
        "bytes_sent_per_step": {"zero": plan.traffic.zero, "features": plan.traffic.features},
        "step_s": plan.step_s,
        "step_s_error": step_calibration(assume.mfu),
        "samples_per_s": plan.samples_per_s,
        "assumptions": asdict(assume),
    }


def to_text(config: str, profile: Profile, plan: Plan, assume: Assumptions) -> str:
    c, s, cl = profile.counts, plan.states, plan.cluster
    toggled = "off" if profile.checkpointing else "on"
    lines = [
        f"{config} on {cl.gpus} x {cl.gpu.name} ({cl.nodes} node(s) of {cl.gpus_per_node}, "
        f"{cl.memory_gib:g} GiB each); "
        f"ZeRO-{plan.layout.stage}{' + offload' if plan.layout.offload else ''}, {plan.layout.precision}",
        f"parameters: {c.trainable:,} trainable, {c.frozen:,} frozen; momentum copies {c.momentum:,}",
        "per GPU:",
        f"  parameters            {gb(s.parameters)}",
        f"  ZeRO-3 gathered layer {gb(s.gathered_layer)}",
        f"  hpZ secondary shard   {gb(s.hpz_shard)}",
        f"  gradients             {gb(s.gradients)}",
        f"  optimizer states      {gb(s.optimizer)}",
        f"  momentum copies       {gb(s.momentum)}",
        f"  buffers and queues    {gb(s.buffers)}",
        f"  DeepSpeed grad bucket {gb(s.reduce_bucket)}",
        f"  activations           {gb(plan.activations)} at micro-batch {plan.micro_batch}"
        + (" (the largest adaptive share) " if plan.adaptive else " ")
        + f"(checkpointing {'on' if profile.checkpointing else 'off'}"
        + ("; one merged pool pass: all the step's micro-batches held" if profile.merged else "")
        + ")"
        + (f"; {gb(plan.activations_other)} with it {toggled}" if plan.activations_other is not None else ""),
        f"  contrastive logits    {gb(plan.logits)} beyond one rank's",
        f"  input batch           {gb(plan.batch)}",
        f"  total                 {gb(plan.gpu_bytes)} of {gb(cl.memory_gib * 2**30 * assume.usable_share)} usable",
        f"host per rank: {gb(plan.host_per_rank)} (offloaded states, loader buffers)",
        f"host while the model is built: rank 0 {gb(plan.build_host[0])}, other ranks {gb(plan.build_host[1])}"
        + _how_built(plan.build_host),
        f"micro-batch {plan.micro_batch}: {'fits' if plan.fits else 'does NOT fit'}; "
        f"largest that fits: {plan.largest_micro_batch}",
        f"FLOPs per sample (forward + backward): {plan.flops_per_sample / 1e9:,.3g} GFLOP",
        f"sent per rank per step: ZeRO {gb(plan.traffic.zero)}, feature gathers {gb(plan.traffic.features)}",
        f"predicted step {plan.step_s:.3f} s, {plan.samples_per_s:,.0f} samples/s ({step_calibration(assume.mfu)})",
        "assumptions:",
        *(f"  {line}" for line in assume.lines()),
        "  peak bf16 / fp32 / HBM: "
        + "; ".join(
            f"{g.name} {g.bf16_tflops:g} / {g.fp32_tflops:g} TFLOPS, {g.hbm_tb_s:g} TB/s" for g in GPUS.values()
        ),
    ]
    return "\n".join(lines)


def _how_built(build_host: tuple[int, int]) -> str:
    if build_host == (0, 0):
        return " (ZeRO-3 builds partitioned from initial weights read tensor by tensor)"
    if build_host[1] == 0:
        return " (ZeRO-3 builds partitioned; rank 0 builds one whole copy in fp32 to start from)"
    return " (each builds the whole model in fp32)"

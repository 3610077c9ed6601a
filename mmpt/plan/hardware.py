"""The accelerators a plan is made for, and the assumptions its step time rests on (printed with every plan)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # HBM per GPU
    bf16_tflops: float  # dense tensor-core peak, no sparsity (TF32's is half of it)
    fp32_tflops: float  # plain fp32, without tensor cores
    hbm_tb_s: float  # HBM bandwidth

    def peak_tflops(self, precision: str, tf32: bool) -> float:
        """The dense peak a run's matrix products meet: bf16 tensor cores, TF32 ones for fp32 with `train.tf32`,
        else plain fp32."""
        if precision != "fp32":
            return self.bf16_tflops
        return self.bf16_tflops / 2 if tf32 else self.fp32_tflops


# Vendor data sheets, SXM parts: dense bf16 peak, fp32 peak and HBM bandwidth.
GPUS = {
    "a100": Gpu("A100-80GB SXM", 80, 312, 19.5, 2.04),
    "h100": Gpu("H100-80GB SXM", 80, 989, 67, 3.35),
    "h200": Gpu("H200-141GB SXM", 141, 989, 67, 4.8),
}


# The predicted step against measured ones (benchmarks/results/gpu/planner.md, one H100: ViT-B/16 at ZeRO-0 and
# ZeRO-2, M²-Encoder 0.4B, VICTOR base; its steps planned at 40% MFU x 40/15, a one-GPU step being compute alone):
# planned / measured - 1 from -24% to +29% at this MFU. SPACE-2 (-66%) is left out: planned at its longest dialogs,
# its step is a bound there, not a prediction.
CALIBRATED_MFU = 0.15
STEP_ERROR = "-24% to +29%"


def step_calibration(mfu: float) -> str:
    """How far the predicted step is known to be from measured ones, for the MFU it assumes."""
    if mfu == CALIBRATED_MFU:
        return f"calibrated on one H100, benchmarks/results/gpu: {STEP_ERROR}"
    return f"MFU {mfu:.0%} not calibrated; at {CALIBRATED_MFU:.0%} on one H100, benchmarks/results/gpu: {STEP_ERROR}"


@dataclass(frozen=True)
class Assumptions:
    """What the plan assumes beyond the measured model; each is a command-line option."""

    # Model FLOPs utilisation of the GPU's peak for the run's precision. On one H100 (benchmarks/results/gpu/planner.md)
    # the eager bf16 steps of ViT-B/16, M²-Encoder 0.4B and VICTOR imply 11-19%; 15% is their middle.
    mfu: float = CALIBRATED_MFU
    intra_node_gb_s: float = 150.0  # bytes a rank sends per second inside a node (NVLink, achieved)
    inter_node_gb_s: float = 25.0  # bytes a rank sends per second across nodes (one 200 Gb/s NIC per GPU, achieved)
    # Of GPU memory left for what the planner counts: the rest holds the CUDA context, NCCL buffers, fragmentation
    # and what it does not count (on one H100 the measured peaks were up to 22% above its prediction: 1/0.75 leaves
    # 33% for that).
    usable_share: float = 0.75
    pinned_batches: int = 2  # micro-batches the loader keeps in pinned host memory per rank

    def lines(self) -> list[str]:
        return [
            f"MFU {self.mfu:.0%} of the peak of the run's precision (bf16; TF32 for fp32 with train.tf32, else fp32); "
            "compute and communication not overlapped",
            f"link bandwidth per rank: {self.intra_node_gb_s:g} GB/s inside a node, {self.inter_node_gb_s:g} GB/s "
            "across nodes (ring collectives)",
            f"usable GPU memory: {self.usable_share:.0%} of HBM; loader: {self.pinned_batches} pinned micro-batches",
        ]

"""One plan: a profiled config on a given number of GPUs of one kind. Memory by part, whether the configured
micro-batch fits, the largest one that does, FLOPs, bytes sent, and the predicted step time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from mmpt.config import Config
from mmpt.engine.deepspeed_config import gpu_reduction
from mmpt.engine.resilience.adaptive_batch import largest_share
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.losses.sigmoid import SigmoidLoss
from mmpt.methods import get_method
from mmpt.plan.comm import Traffic, feature_bytes, zero_bytes
from mmpt.plan.hardware import Assumptions, Gpu
from mmpt.plan.logits import Gathering, extra_logits_bytes
from mmpt.plan.profile import Profile
from mmpt.plan.states import Layout, States, model_states

LARGEST_SEARCHED = 1 << 20


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: Gpu
    memory_gib: float  # usable HBM per GPU as given (may differ from the GPU's nominal size)

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.gpus_per_node))


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    layout: Layout
    states: States
    micro_batch: int  # as configured; with adaptive batches the largest a rank may hold
    adaptive: bool  # train.adaptive_batch
    activations: int  # working bytes of one micro-batch, as configured (checkpointing on or off)
    activations_other: int | None  # the other way round (None: the model has no checkpointing switch)
    logits: int  # what gathering over the real ranks adds to the contrastive logits
    batch: int  # the micro-batch's input tensors on the GPU
    host_per_rank: int
    build_host: tuple[int, int]  # host bytes while the model is built: (rank 0, any other rank)
    largest_micro_batch: int  # 0: not even one sample fits
    flops_per_sample: float  # model FLOPs, forward + backward
    traffic: Traffic
    step_s: float
    samples_per_s: float

    @property
    def gpu_bytes(self) -> int:
        return self.states.gpu + self.activations + self.logits + self.batch

    @property
    def fits(self) -> bool:
        return self.largest_micro_batch >= self.micro_batch


def gathering(cfg: Config, profile: Profile, cluster: Cluster) -> tuple[Gathering, str]:
    """How the loss gathers features on `cluster`, and the kind of feature traffic."""
    sources = len(cfg.data.train.sources) if cfg.data.train.compose == "per_source" else 1
    loss, spec = profile.loss, getattr(cast(Any, cfg.method), "loss", None)  # the method's own loss section
    pooled = cfg.train.grad_accum if getattr(spec, "pooled_accumulation", True) else 1
    data_ranks = cluster.gpus // cfg.train.sequence_parallel
    if isinstance(loss, GroupedContrastiveLoss):
        size = getattr(spec, "group_size", "world")  # GBA-ITC's; one group of all ranks otherwise
        group = {"world": data_ranks, "auto": min(cluster.gpus_per_node, data_ranks)}.get(size)
        group = int(group if group is not None else size)
        return Gathering(data_ranks, group, pooled, sources), "grouped" if pooled > 1 else "global"
    if isinstance(loss, SigmoidLoss):
        return Gathering(data_ranks, data_ranks, pooled, sources), "global"
    return Gathering(data_ranks, data_ranks, 1, sources), "none"


def working_bytes(profile: Profile, cfg: Config, cluster: Cluster, micro: int) -> tuple[int, int, int]:
    """(activations, extra logits, input batch) of a micro-batch of `micro` samples. A merged pool pass holds the
    step's K micro-batches until its one backward: K times one's (an upper bound: one's transient peak K times)."""
    gather, _ = gathering(cfg, profile, cluster)
    held = cfg.train.grad_accum if profile.merged else 1
    return (
        int(profile.activations.at(micro)) * held,
        extra_logits_bytes(profile.loss, micro, gather),
        int(profile.batch_bytes_per_sample * micro),
    )


def largest_micro_batch(profile: Profile, cfg: Config, cluster: Cluster, budget: float) -> int:
    """The largest micro-batch whose working bytes fit `budget` (0 if none)."""

    def fits(micro: int) -> bool:
        return sum(working_bytes(profile, cfg, cluster, micro)) <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while high < LARGEST_SEARCHED and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def make_plan(cfg: Config, profile: Profile, cluster: Cluster, assume: Assumptions) -> Plan:
    train = cfg.train
    hpz = train.hpz_partition_size
    bucket, overlap = gpu_reduction(train, profile.counts.trainable + profile.counts.frozen, cluster.gpus)
    layout = Layout(
        world=cluster.gpus,
        precision=train.precision,
        stage=train.zero_stage,
        offload=train.offload_optimizer,
        hpz=cluster.gpus_per_node if hpz == "node" else int(hpz or 1),
        # DeepSpeed's gradient bucket as the engine configures it on GPUs (mmpt.engine.deepspeed_config)
        reduce_bucket=bucket if train.zero_stage in (1, 2) else train.reduce_bucket_size or 0,
        contiguous_gradients=True,
        overlap_comm=overlap,
    )
    states = model_states(profile.counts, layout)
    budget = cluster.memory_gib * 2**30 * assume.usable_share - states.gpu
    micro = largest_share(cfg)  # memory: the largest micro-batch a rank may hold
    equal = cfg.data.train.batch_size  # throughput and traffic: the mean share
    activations, logits, batch = working_bytes(profile, cfg, cluster, micro)
    other = profile.activations_other
    largest = largest_micro_batch(profile, cfg, cluster, budget)
    width = 4 if train.precision == "fp32" else 2
    gather, kind = gathering(cfg, profile, cluster)
    params = profile.counts.trainable + profile.counts.frozen
    zero = zero_bytes(params, width, layout.stage, cluster.gpus, train.grad_accum, layout.hpz)
    features = feature_bytes(kind, equal, profile.feature_dim, width, gather.group, train.grad_accum)
    traffic = Traffic(zero, features, zero_inter_node=cluster.nodes > 1)
    samples = equal * train.grad_accum
    flops = profile.model_flops.per_sample
    compute_s = flops * samples / (cluster.gpu.peak_tflops(train.precision, train.tf32) * 1e12 * assume.mfu)
    zero_gb_s = assume.inter_node_gb_s if traffic.zero_inter_node else assume.intra_node_gb_s
    group_crosses = gather.group > cluster.gpus_per_node
    feature_gb_s = assume.inter_node_gb_s if group_crosses else assume.intra_node_gb_s
    step_s = compute_s + zero / (zero_gb_s * 1e9) + features / (feature_gb_s * 1e9)
    loader = cfg.data.train
    host = states.host + batch * (assume.pinned_batches + loader.num_workers * 4)
    whole = 4 * (params + profile.counts.momentum)  # the model as built, in fp32
    # ZeRO-3 on several ranks builds partitioned (see engine/zero3/build.py): rank 0 alone holds a whole copy,
    # unless the initial weights cover the model and are read tensor by tensor.
    partitioned = layout.stage == 3 and cluster.gpus > 1
    streamed = partitioned and get_method(cfg.method_name).initial_tensors(cfg) is not None
    return Plan(
        cluster=cluster,
        layout=layout,
        states=states,
        micro_batch=micro,
        adaptive=train.adaptive_batch,
        activations=activations,
        activations_other=int(other.at(micro)) if other is not None else None,
        logits=logits,
        batch=batch,
        host_per_rank=host,
        build_host=(0 if streamed else whole, 0 if partitioned else whole),
        largest_micro_batch=largest,
        flops_per_sample=flops,
        traffic=traffic,
        step_s=step_s,
        samples_per_s=samples * cluster.gpus / train.sequence_parallel / step_s,
    )

"""Activation memory per rank against sequence length, with and without Ulysses sequence parallelism.

VICTOR's transformer block stack (`mmpt.models.victor.Transformer`: timm pre-LN blocks, fused attention)
at width 128, 4 heads, 2 layers, batch 2, fp32, on 2 CPU ranks (gloo). "SP 1": each rank runs the whole
sequence (plain data parallelism). "SP 2": the engine's split (`mmpt.engine.sequence_parallel`), each rank
runs half the tokens and attention gets all tokens for half the heads through DeepSpeed's all-to-all.

Activation memory is what autograd keeps for backward: every tensor saved by the ops inside the
transformer's forward (`torch.autograd.graph.saved_tensors_hooks`) except the parameters, each storage counted
once over the span its saved views cover, on rank 0.
It is exact and independent of the allocator. The whole-sequence tensors the transformer takes and
returns (B x L x W each) are outside this count: sequence parallelism does not split them.
Time is the median of 3 forward+backward passes on 2 shared cores (gloo all-to-all included): a
sanity figure, not a GPU one.

    python benchmarks/sequence_parallel.py      # ~3 minutes on 2 cores
Results: benchmarks/results/sequence_parallel.{json,md,png}.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, free_port, save_results

WIDTH, HEADS, LAYERS, BATCH, RANKS = 128, 4, 2, 2, 2
LENGTHS = (256, 512, 1024, 2048, 4096)


def saved_bytes(run, model: torch.nn.Module) -> int:
    """Bytes autograd saves for backward while `run()` executes, parameters left out: per storage, the span
    its saved views cover (q, k and v are views of one projection; this rank's slice of the input is a view of
    the whole input, which exists outside the transformer and is not counted whole)."""
    spans: dict[int, tuple[int, int]] = {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor):
        if tensor.numel() and tensor.untyped_storage().data_ptr() not in parameters:
            size = tensor.element_size()
            start = tensor.storage_offset() * size
            end = start + size * (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())))
            key = tensor.untyped_storage().data_ptr()
            low, high = spans.get(key, (start, end))
            spans[key] = (min(low, start), max(high, end))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(high - low for low, high in spans.values())


def measure(model, length: int, repeats: int = 3) -> dict:
    tokens = torch.randn(BATCH, length, WIDTH, generator=torch.Generator().manual_seed(length), requires_grad=True)
    memory = saved_bytes(lambda: model(tokens).sum().backward(), model)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        model(tokens).sum().backward()
        times.append(time.perf_counter() - start)
    return {"saved_mib": memory / 2**20, "time_s": statistics.median(times)}


def worker(rank: int, port: int, queue) -> None:
    import deepspeed

    from mmpt.engine.sequence_parallel import split_sequences
    from mmpt.models.victor import Transformer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS)
    )
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    whole = Transformer(WIDTH, LAYERS, HEADS)
    split = Transformer(WIDTH, LAYERS, HEADS)
    split.load_state_dict(whole.state_dict())
    split_sequences([split], dist.new_group(list(range(RANKS))), RANKS)
    for length in LENGTHS:
        for sp, model in ((1, whole), (RANKS, split)):
            result = measure(model, length)
            if rank == 0:
                queue.put({"length": length, "sequence_parallel": sp, **result})
                print(
                    f"L={length:5d} SP={sp} saved {result['saved_mib']:8.1f} MiB  {result['time_s'] * 1e3:8.1f} ms",
                    flush=True,
                )
    dist.barrier()
    if rank == 0:
        queue.put(None)


def write_report(rows: list[dict]) -> None:
    meta = {
        "width": WIDTH,
        "heads": HEADS,
        "layers": LAYERS,
        "batch": BATCH,
        "ranks": RANKS,
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "torch": torch.__version__,
    }
    by = {(r["length"], r["sequence_parallel"]): r for r in rows}
    lines = [
        "# Activation memory per rank: Ulysses sequence parallelism (SP) against the whole sequence",
        "",
        f"VICTOR's transformer, width {WIDTH}, {HEADS} heads, {LAYERS} layers, batch {BATCH}, fp32, {RANKS} CPU "
        f"ranks (gloo), torch {torch.__version__}, {meta['machine']}. Saved: bytes autograd keeps for backward "
        "inside the transformer, on rank 0 (exact). Time: median fwd+bwd on shared cores.",
        "",
        "| tokens L | saved MiB, SP 1 | saved MiB, SP 2 | SP 2 / SP 1 | ms, SP 1 | ms, SP 2 |",
        "|---|---|---|---|---|---|",
    ]
    for length in LENGTHS:
        one, two = by[(length, 1)], by[(length, RANKS)]
        lines.append(
            f"| {length} | {one['saved_mib']:.1f} | {two['saved_mib']:.1f} | "
            f"{two['saved_mib'] / one['saved_mib']:.3f} | {one['time_s'] * 1e3:.0f} | {two['time_s'] * 1e3:.0f} |"
        )
    save_results("sequence_parallel", {"setup": meta, "rows": rows}, lines)
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for sp, label in ((1, "whole sequence (SP 1)"), (RANKS, f"Ulysses, SP {RANKS}")):
        series = sorted((r["length"], r["saved_mib"]) for r in rows if r["sequence_parallel"] == sp)
        ax.plot([s[0] for s in series], [s[1] for s in series], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens per sequence L")
    ax.set_ylabel("activation memory per rank (MiB)")
    ax.set_title(f"VICTOR transformer, W={WIDTH}, {LAYERS} layers, batch {BATCH}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "sequence_parallel.png", dpi=110)


def main() -> None:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    processes = [ctx.Process(target=worker, args=(rank, port, queue)) for rank in range(RANKS)]
    for p in processes:
        p.start()
    rows = []
    while (item := queue.get()) is not None:
        rows.append(item)
    for p in processes:
        p.join()
    write_report(rows)


if __name__ == "__main__":
    main()

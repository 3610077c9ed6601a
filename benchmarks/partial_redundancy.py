"""ZeRO-3 against ZeRO++ hierarchical partitioning (hpZ) on 2 "nodes" x 2 CPU ranks: bytes each rank
moves per training step, split by whether the collective spans nodes, and what each rank holds.

Each variant trains the open_clip benchmark model (`configs/bench-vit-tiny.json`, 22M parameters,
fp32, AdamW, per-rank batch 8) with two torchrun launchers (`--nnodes 2 --node_rank i`, rendezvous on
127.0.0.1), so LOCAL_WORLD_SIZE = 2 and `hpz_partition_size: node` forms one group per node. Every rank
runs `launch/train.py` in this script's `--worker` mode, which counts the collectives (installed before
DeepSpeed keeps its own reference) over steps 2-3 and measures, after a forward pass, the parameter
shards it holds: ZeRO-3's primary shard (1/4 of each partitioned parameter) and hpZ's secondary one
(1/2, alive from forward to the end of the step), plus its optimizer state.

DeepSpeed keeps a parameter gathered from forward to backward when it is used again within
`stage3_max_reuse_distance` elements (default 1e9): at 22M parameters that is all of them, and backward
gathers nothing. The worker sets it to 0, so backward gathers again, as it does for a model whose
layers do not all fit gathered at once, which is where ZeRO-3 and hpZ are used. Each is run with
DeepSpeed's parameter prefetching (`stage3_prefetch_bucket_size`, default 5e7 elements) and without (0).

Bytes per rank are what a ring algorithm moves through each rank for a collective over G ranks:
all-gather (G-1)/G of the gathered output, reduce-scatter (G-1)/G of the input, all-reduce twice that.
Results: benchmarks/results/partial_redundancy.{json,md}.

    python benchmarks/partial_redundancy.py        # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import runpy
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml
from demo_runs import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MODEL = REPO / "benchmarks" / "configs" / "bench-vit-tiny.json"
NODES, PER_NODE, MEASURED_STEPS = 2, 2, 2
# (train section keys, DeepSpeed's stage3_prefetch_bucket_size: None = its default of 5e7 elements)
VARIANTS = {
    "ZeRO-3": ({}, None),
    "ZeRO-3 + hpZ (node)": ({"hpz_partition_size": "node"}, None),
    "ZeRO-3, no prefetch": ({}, 0),
    "ZeRO-3 + hpZ (node), no prefetch": ({"hpz_partition_size": "node"}, 0),
}
RING_FACTOR = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}


# ---- worker: one rank of a variant, under torchrun ----


def worker(out: Path, train_args: list[str]) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    counts = defaultdict(float)  # "op/G" -> bytes this rank moves over the measured steps
    state = {"steps": 0, "memory": {}}

    def counting(op, original, names, measured):
        """`original` (parameters `names`, in order), counting the bytes of its `measured` tensor."""

        def call(*args, **kwargs):
            bound = dict(zip(names, args)) | kwargs
            size = dist.get_world_size(bound.get("group"))
            if 1 <= state["steps"] <= MEASURED_STEPS and size > 1:
                counts[f"{op}/{size}"] += RING_FACTOR[op] * (size - 1) / size * bound[measured].nbytes
            return original(*args, **kwargs)

        return call

    dist.all_gather_into_tensor = counting(
        "all_gather_into_tensor",
        dist.all_gather_into_tensor,
        ["output_tensor", "input_tensor", "group"],
        "output_tensor",
    )
    dist.reduce_scatter_tensor = counting(
        "reduce_scatter_tensor", dist.reduce_scatter_tensor, ["output", "input", "op", "group"], "input"
    )
    dist.all_reduce = counting("all_reduce", dist.all_reduce, ["tensor", "op", "group"], "tensor")

    initialize = deepspeed.initialize

    def measuring_initialize(*args, **kwargs):
        zero = kwargs["config"]["zero_optimization"]
        zero["stage3_max_reuse_distance"] = 0  # see the module docstring
        if os.environ.get("PREFETCH_BUCKET"):
            zero["stage3_prefetch_bucket_size"] = int(os.environ["PREFETCH_BUCKET"])
        engine, *rest = initialize(*args, **kwargs)
        backward, step = engine.backward, engine.step

        def measuring_backward(*a, **k):  # after forward: hpZ's secondary shards are alive here
            if state["steps"] == 1 and not state["memory"]:  # Adam's state exists after the first step
                params = list(engine.module.parameters())
                state["memory"] = {
                    "primary_shard_mib": sum(p.ds_tensor.nbytes for p in params if hasattr(p, "ds_tensor")) / 2**20,
                    "secondary_shard_mib": sum(
                        p.ds_secondary_tensor.nbytes
                        for p in params
                        if getattr(p, "ds_secondary_tensor", None) is not None
                    )
                    / 2**20,
                    "optimizer_state_mib": sum(
                        t.nbytes
                        for s in engine.optimizer.optimizer.state.values()
                        for t in s.values()
                        if torch.is_tensor(t)
                    )
                    / 2**20
                    + sum(t.nbytes for t in engine.optimizer.fp32_partitioned_groups_flat) / 2**20,
                    "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
                }
            return backward(*a, **k)

        def counting_step(*a, **k):
            result = step(*a, **k)
            state["steps"] += 1
            return result

        engine.backward, engine.step = measuring_backward, counting_step
        return (engine, *rest)

    deepspeed.initialize = measuring_initialize

    def save() -> None:
        rank = int(os.environ["RANK"])
        (out / f"rank{rank}.json").write_text(json.dumps({"bytes": counts, **state["memory"]}))

    atexit.register(save)
    sys.argv = [str(REPO / "launch/train.py"), *train_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ---- driver ----


def run_variant(name: str, train: dict, prefetch: int | None, digits: Path, work: Path) -> list[dict]:
    here = work / "".join(c if c.isalnum() else "_" for c in name)
    (here / "records").mkdir(parents=True)
    config = {
        "method": {"name": "open_clip", "model": str(MODEL), "zeroshot": {"dataset": None}},
        "data": {
            "train": {
                "sources": [{"shards": str(digits / "train/en-*.tar")}],
                "mode": "resampled",
                "batch_size": 8,
                "num_workers": 1,
                "shuffle_buffer": 100,
            }
        },
        "optim": {"lr": 1e-4, "warmup_steps": 1},
        "train": {
            "max_steps": MEASURED_STEPS + 2,
            "grad_clip": 0.0,
            "zero_stage": 3,
            "log_every": 1,
            "save_every": 0,
            "watchdog_timeout": 0,
            **train,
        },
        "run": {"output_dir": str(here / "run"), "resume": "none", "tensorboard": False, "progress_bar": False},
    }
    (here / "cfg.yaml").write_text(yaml.safe_dump(config))
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(
        {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PREFETCH_BUCKET": "" if prefetch is None else str(prefetch)}
    )
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(NODES),
                "--node_rank",
                str(node),
                "--nproc_per_node",
                str(PER_NODE),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                __file__,
                "--worker",
                str(here / "records"),
                "--config",
                str(here / "cfg.yaml"),
            ],
            cwd=REPO,
            env=env,
            stdout=(here / f"node{node}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for node in range(NODES)
    ]
    for launcher in launchers:
        if launcher.wait(timeout=900):
            raise SystemExit(f"{name} failed; see {here}/node*.log")
    return [json.loads((here / f"records/rank{r}.json").read_text()) for r in range(NODES * PER_NODE)]


def main() -> None:
    import torch

    from mmpt import demo

    rows = {}
    with tempfile.TemporaryDirectory() as work:
        digits = demo.build("digits", Path(work) / "data")
        for name, (train, prefetch) in VARIANTS.items():
            rows[name] = run_variant(name, train, prefetch, digits, Path(work))
    machine = (
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {NODES} torchrun nodes x {PER_NODE} CPU ranks "
        f"(gloo) on one host, fp32; python {sys.version.split()[0]}, torch {torch.__version__}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "partial_redundancy.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    world = NODES * PER_NODE
    lines = [
        f"{machine}. Model `bench-vit-tiny.json` ({rows['ZeRO-3'][0]['parameters'] / 1e6:.1f}M parameters). "
        "Produced by `benchmarks/partial_redundancy.py`.",
        "",
        "| variant | MiB/step/rank, collectives over both nodes | inside one node | all-gather only: both nodes / "
        "one node | primary shard MiB | secondary shard MiB | optimizer state MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ranks in rows.items():

        def per_step(scope, op=""):
            size = str(world) if scope == "across" else str(PER_NODE)
            return (
                max(sum(v for k, v in r["bytes"].items() if k.endswith("/" + size) and k.startswith(op)) for r in ranks)
                / MEASURED_STEPS
                / 2**20
            )

        first = ranks[0]
        lines.append(
            f"| {name} | {per_step('across'):.1f} | {per_step('inside'):.1f} | "
            f"{per_step('across', 'all_gather'):.1f} / {per_step('inside', 'all_gather'):.1f} | "
            f"{first['primary_shard_mib']:.1f} | {first['secondary_shard_mib']:.1f} | "
            f"{first['optimizer_state_mib']:.1f} |"
        )
    (RESULTS / "partial_redundancy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
        main()

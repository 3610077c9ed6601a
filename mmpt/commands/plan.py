"""Plan a config's memory and throughput before asking for GPUs.

    python launch/plan.py --config configs/m2_encoder/10b.yaml --gpus 32 --gpus-per-node 8 --gpu h100
    mmpt-plan --config C [key.path=value ...] --gpus N --gpu-memory 80 [--json]

Counts come from a meta-device build of the model through its method; activation bytes and FLOPs from one
training micro-batch run on fake tensors at full size (docs/planning.md). A config that cannot fit even one
sample per GPU is said in one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json

from mmpt.commands import installed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from mmpt.plan.hardware import GPUS, Assumptions

    defaults = Assumptions()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train.batch_size=32")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="peak FLOPs and default memory")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: the GPU's)")
    parser.add_argument("--mfu", type=float, default=defaults.mfu)
    parser.add_argument("--intra-node-gb-s", type=float, default=defaults.intra_node_gb_s)
    parser.add_argument("--inter-node-gb-s", type=float, default=defaults.inter_node_gb_s)
    parser.add_argument(
        "--usable-share", type=float, default=defaults.usable_share, help="share of GPU memory a plan may fill"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mmpt.config import ConfigError
    from mmpt.config_loader import load_config
    from mmpt.plan.hardware import GPUS, Assumptions
    from mmpt.plan.planner import Cluster, make_plan
    from mmpt.plan.profile import profile
    from mmpt.plan.render import to_json, to_text

    if args.gpus < 1 or args.gpus_per_node < 1:
        raise ConfigError("--gpus and --gpus-per-node must be at least 1")
    cfg = load_config(args.config, args.overrides)
    gpu = GPUS[args.gpu]
    cluster = Cluster(args.gpus, min(args.gpus_per_node, args.gpus), gpu, args.gpu_memory or gpu.memory_gib)
    if not 0 < args.usable_share <= 1:
        raise ConfigError(f"--usable-share {args.usable_share} must be in (0, 1]")
    assume = Assumptions(
        mfu=args.mfu,
        intra_node_gb_s=args.intra_node_gb_s,
        inter_node_gb_s=args.inter_node_gb_s,
        usable_share=args.usable_share,
    )
    found = profile(cfg)
    plan = make_plan(cfg, found, cluster, assume)
    if plan.largest_micro_batch == 0:
        remedies = ["add GPUs"]
        remedies += ["raise train.zero_stage"] if plan.layout.stage < 3 else []
        remedies += ["set train.offload_optimizer"] if not cfg.train.offload_optimizer else []
        raise ConfigError(
            f"{args.config} does not fit {cluster.gpus} x {cluster.memory_gib:g} GiB at micro-batch 1: model states "
            f"alone take {plan.states.gpu / 1e9:.1f} GB per GPU (ZeRO-{plan.layout.stage}); {', '.join(remedies)}"
        )
    print(
        json.dumps(to_json(args.config, found, plan, assume), indent=2)
        if args.json
        else to_text(args.config, found, plan, assume)
    )
    return 0


run = installed(main)

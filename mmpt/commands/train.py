"""Train a method from a config.

    deepspeed --num_gpus N launch/train.py --config configs/clip/demo.yaml [key.path=value ...]
    torchrun --nproc_per_node N launch/train.py --config ...
    mmpt-train --config ...                        (one process; or python launch/train.py)
    ... launch/train.py --import my_package.my_method --config ...   (a method defined outside mmpt)

The config is validated before any process group starts; an error is one line naming the key.
Every expected stop (config, data, non-finite training, hang) ends with one line per rank and an
exit code listed in `mmpt/engine/stops.py`; `MMPT_DEBUG=1` shows tracebacks instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

from mmpt.commands import add_import_option, import_modules


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config file")
    add_import_option(parser, "the config")
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4 train.max_steps=100")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(args, rank)
    except Exception as exc:
        from mmpt.engine import stops

        end = stops.ending(exc, rank)
        if end is None or stops.debugging():
            raise
        stops.say(end.line)
        time.sleep(end.linger_s)
        return end.exit_code


def run(args: argparse.Namespace, rank: int) -> int:
    from mmpt.config_loader import load_config
    from mmpt.engine.deepspeed_config import check_precision

    import_modules(args.imports)
    cfg = load_config(args.config, args.overrides)  # validated before any process group starts
    check_precision(cfg)
    configure_output(rank)
    from mmpt.engine import train

    train(cfg)
    return 0


def configure_output(rank: int) -> None:
    """Rank 0 logs from INFO, the others from WARNING, each line naming its rank; what libraries say, once."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    # Libraries that log on the root logger itself (open_clip: some 30 lines a run on model configs and image
    # preprocessing) say their warnings only; named loggers (mmpt's, a method's of its own) keep their INFO.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: record.name != "root" or record.levelno >= logging.WARNING)
    # huggingface_hub prints through a handler of its own (as transformers does, which does not propagate): once.
    logging.getLogger("huggingface_hub").propagate = False
    # torch 2.14 renamed these collectives; DeepSpeed 0.19.8 (pinned) and mmpt call the names every torch release
    # has: news for neither the user nor each rank.
    warnings.filterwarnings(
        "ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning
    )

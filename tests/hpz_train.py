"""`launch/train.py`, counting on every rank the parameter all-gathers by the size of the group they
gather over, into `$MMPT_RECORD_DIR/rank<R>.json` at exit. Installed before DeepSpeed starts, which
keeps its own reference to the collective. tests/test_partial_redundancy.py reads the counts to see
where ZeRO-3 and ZeRO++'s hierarchical partitioning gather parameters."""

import atexit
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

TRAIN = Path(__file__).resolve().parents[1] / "launch/train.py"
gathers: Counter = Counter()
all_gather_into_tensor = dist.all_gather_into_tensor


def counting_all_gather_into_tensor(*args, **kwargs):
    group = kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)
    gathers[str(dist.get_world_size(group))] += 1
    return all_gather_into_tensor(*args, **kwargs)


def save() -> None:
    (Path(os.environ["MMPT_RECORD_DIR"]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(gathers))


dist.all_gather_into_tensor = counting_all_gather_into_tensor
atexit.register(save)
sys.argv[0] = str(TRAIN)
runpy.run_path(str(TRAIN), run_name="__main__")

"""`python -m open_clip_train.main` with mmpt's shipped model configs registered first; where MMPT_PEAK_FILE is
set, the run's peak allocated GPU memory is written there as it ends (open_clip's log has none)."""

import atexit
import json
import os
import sys
from pathlib import Path

import open_clip
import torch
from open_clip_train.main import main

from mmpt.models.open_clip_model import SHIPPED_MODEL_CONFIGS


def write_peak() -> None:
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    Path(os.environ["MMPT_PEAK_FILE"]).write_text(json.dumps({"peak_allocated_gib": peak}))


if __name__ == "__main__":
    open_clip.add_model_config(SHIPPED_MODEL_CONFIGS)
    if os.environ.get("MMPT_PEAK_FILE"):
        atexit.register(write_peak)
    main(sys.argv[1:])

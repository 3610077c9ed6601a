"""`python -m open_clip_train.main` with the benchmark's model config registered first.

One compatibility shim, needed for multi-process CPU runs only: open_clip's trainer wraps the model
in DistributedDataParallel with `device_ids=[device]` even when the device is the CPU, which DDP
rejects; for CPU devices the ids are dropped (what DDP expects there). The training work is unchanged.
"""

import sys
from pathlib import Path

import open_clip
import torch
from open_clip_train.main import main


class CpuDeviceIdsDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, device_ids=None, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids=device_ids, **kwargs)


if __name__ == "__main__":
    open_clip.add_model_config(Path(__file__).resolve().parent / "configs")
    torch.nn.parallel.DistributedDataParallel = CpuDeviceIdsDDP
    main(sys.argv[1:])

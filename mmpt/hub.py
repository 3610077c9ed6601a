"""Loading a finished run or a release for evaluation or use (see `mmpt.release`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmpt.config import Config
from mmpt.methods import Method


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Config, Method, nn.Module]:
    """(config, method, model in eval mode) of a run or release directory; weights are loaded strictly."""
    from mmpt.release import load_directory

    loaded = load_directory(run_dir, device)
    return loaded.config, loaded.method, loaded.model

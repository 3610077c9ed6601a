"""Loading a finished run (config.yaml + model.safetensors + tokenizer files) for evaluation or use."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from mmpt.config import Config, load_config
from mmpt.methods import Method, get_method

WEIGHTS = "model.safetensors"


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Config, Method, nn.Module]:
    """(config, method, model in eval mode) of a run directory; weights are loaded strictly."""
    run_dir = Path(run_dir)
    for needed in ("config.yaml", WEIGHTS):
        if not (run_dir / needed).is_file():
            raise FileNotFoundError(f"{run_dir} is not a finished run: {needed} is missing")
    cfg = load_config(run_dir / "config.yaml")
    method = get_method(cfg.method_name)
    model = method.build_model(cfg, run_dir)
    state = load_file(str(run_dir / WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"{run_dir / WEIGHTS} does not match the '{cfg.method_name}' model: "
            f"missing {sorted(missing)[:10]}, unexpected {sorted(unexpected)[:10]}"
        )
    return cfg, method, model.to(device).eval()

"""Optimizer with weight-decay groups and the warmup + cosine (or linear) learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatchcase

import torch
from torch import nn

from mmpt.config import ConfigError, OptimConfig, TrainConfig


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay: list[str],
    lr: float | None = None,
    lr_scales: dict | None = None,
    layer_scales: dict[int, float] | None = None,
) -> list[dict]:
    """Biases, norms, 1-D parameters and names matching `no_decay` get no weight decay; names matching a pattern of
    `lr_scales` (fnmatch, the first that matches) get `lr` times its scale, and times `layer_scales[id(param)]`
    where given. Frozen parameters are left out."""
    scales, by_layer = lr_scales or {}, layer_scales or {}
    unused = set(scales)
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        dims = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partition is flat: its full shape counts
        decays = not (dims <= 1 or any(pattern in name.lower() for pattern in no_decay))
        pattern = next((p for p in scales if fnmatchcase(name, p)), None)
        unused.discard(pattern)
        scale = (scales[pattern] if pattern else 1.0) * by_layer.get(id(param), 1.0)
        groups.setdefault((decays, scale), []).append(param)
    if unused:
        example = next((name for name, _ in model.named_parameters()), "")
        raise ConfigError(
            f"config key 'optim.lr_scales': {sorted(unused)[0]!r} matches no trainable parameter (names look like "
            f"{example!r})"
        )
    ordered = sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1] != 1.0, item[0][1]))
    return [
        {"params": params, "weight_decay": weight_decay if decays else 0.0}
        | ({"lr": lr * scale} if scale != 1.0 and lr is not None else {})
        for (decays, scale), params in ordered
    ]


class SkippingAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose gradients are not all finite, without reading anything back to the host.

    For ZeRO stages 0-2 (`skips_on_device`). The finiteness flag stays on the device: the fused kernel takes
    it as `found_inf` (the hook torch's GradScaler uses) and then leaves weights, moments and step counts
    untouched. DeepSpeed therefore sees every step as applied; `skipped` (1.0 after a skipped step, else
    0.0) is what the engine's non-finite guard accumulates and reads once per logging window. At ZeRO 1-2 this
    optimizer steps one rank's partition, so the flag comes from the global gradient norm
    (`global_norm`, `deepspeed_private.skip_on_device`), the same on every rank.
    """

    overflow = False  # what DeepSpeed reads; the real answer is the device tensor `skipped`

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skipped: torch.Tensor | None = None
        self.checked: torch.Tensor | None = None  # the next step's flag, when the gradients' reduction found it
        self.global_norm: Callable[[], torch.Tensor] | None = None  # ZeRO 1-2: -1 or non-finite when invalid

    def take_found_inf(self, flag: torch.Tensor) -> None:
        """The next step's non-finite flag, found by whoever reduced the gradients (a device tensor, 1.0 or
        0.0): the step then skips its own check."""
        self.checked = flag

    @torch.no_grad()
    def step(self, closure=None):
        if self.checked is not None:
            self.found_inf, self.checked = self.checked, None
        elif self.global_norm is not None:
            norm = self.global_norm()
            self.found_inf = (~torch.isfinite(norm) | (norm < 0)).float()
        else:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if not grads:
                return super().step(closure)
            # One (foreach) norm over all gradients: non-finite exactly when some entry is inf or nan.
            self.found_inf = (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).float()
        self.skipped = self.found_inf
        return super().step(closure)


def layer_scales(towers: dict[str, list[list[nn.Parameter]]], decay: float | None) -> dict[int, float]:
    """{id(param): decay^k} for each tower's parameters, k groups before its last group (EVA-CLIP's layer decay)."""
    if decay is None:
        return {}
    if not towers:
        raise ConfigError("config key 'optim.layer_decay': this method declares no towers whose layers it could scale")
    return {id(p): decay ** (len(gs) - 1 - k) for gs in towers.values() for k, group in enumerate(gs) for p in group}


def skips_on_device(train: TrainConfig) -> bool:
    """Whether non-finite steps are skipped by `SkippingAdamW` rather than by DeepSpeed's host-side check:
    not at ZeRO-3, with fp16's loss scaling or with the optimizer offloaded to the host."""
    return train.zero_stage < 3 and train.precision != "fp16" and not train.offload_optimizer


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, towers: dict[str, list[list[nn.Parameter]]] | None = None, skipping: bool = True
) -> torch.optim.Optimizer:
    """AdamW over `param_groups` (`SkippingAdamW` where `skipping`); `towers` (the method's
    `EngineNeeds.tower_groups`) for `cfg.layer_decay`."""
    by_layer = layer_scales(towers or {}, cfg.layer_decay)
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay, cfg.lr, cfg.lr_scales, by_layer)
    kind = SkippingAdamW if skipping else torch.optim.AdamW
    # The fused kernel (CPU and CUDA) updates all parameters in one pass instead of a Python loop.
    return kind(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def warmup_cosine(
    warmup_steps: int, total_steps: int, min_ratio: float = 0.0, decay: str = "cosine"
) -> Callable[[int], float]:
    """LR multiplier: linear from 1/warmup to 1 over `warmup_steps`, then `decay` (cosine or linear) to `min_ratio`.

    Kept rather than taken from transformers because the warmup is open_clip's (`(step + 1) / warmup`:
    the first step already learns, where transformers' schedules start at 0), so a run steps through the
    same learning rates as `open_clip_train`'s `cosine_lr`; after warmup it is transformers'
    `get_cosine_with_min_lr_schedule_with_warmup` (cosine) or a linear decay with the same floor, which
    transformers' linear schedule lacks. tests/test_engine.py checks both equalities.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * shape

    return factor


def optimizer_state_bytes(optimizer, model: nn.Module) -> int:
    """Bytes this rank's optimizer holds besides the model's own parameters: moments and, under ZeRO or
    mixed precision, fp32 master copies (partitioned ones count only this rank's part)."""
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def count(tensor) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in model_storages or pointer in seen:
            return
        seen.add(pointer)
        total += tensor.untyped_storage().nbytes()

    inner = optimizer
    while inner is not None:
        for state in getattr(inner, "state", {}).values():
            for value in state.values() if isinstance(state, dict) else ():
                count(value)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                count(param)
        inner = getattr(inner, "optimizer", None)
    return total

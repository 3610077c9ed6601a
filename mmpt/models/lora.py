"""LoRA adapters through peft: low-rank updates beside chosen linear layers, the only parameters that train.

peft wraps each targeted `nn.Linear` in place (its weight becomes `<name>.base_layer.weight`, the adapter
`<name>.lora_A.default.weight` and `<name>.lora_B.default.weight`); the adapter's B starts at zero, so the adapted
model starts as the base model. `merge_lora` folds the updates back into plain linear layers with the base names.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from pydantic import Field
from torch import nn

from mmpt.config import ConfigError, Section

KEY = "method.lora"


class LoraSettings(Section):
    """`method.lora`: which linear layers get adapters and how large they are (peft's LoraConfig)."""

    targets: list[str] = Field(
        min_length=1,
        description="linear layers to adapt: module names or name suffixes (e.g. [q_proj, v_proj] in transformers "
        "models, [c_fc, c_proj] in open_clip's: the out_proj of torch's MultiheadAttention cannot be), peft's "
        "target_modules",
    )
    rank: int = Field(default=8, gt=0, description="rank r of each update")
    alpha: int = Field(default=16, gt=0, description="updates are scaled by alpha / rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input")
    also_train: list[str] = Field(
        default_factory=list,
        description="parameters that train beside the adapters: fnmatch patterns on the names model.safetensors "
        "has (e.g. [image_projection.*, text_projection.*, logit_scale] for the clip method's new heads on "
        "pretrained towers); peft's modules_to_save",
    )
    merge_on_export: bool = Field(
        default=True,
        description="exports and releases made by launch/export.py fold the adapters into the weights (the "
        "base architecture); false keeps them (the run's own layout)",
    )


class LoraOption(Section):
    """The `method.lora` key of the methods that offer adapters."""

    lora: LoraSettings | None = Field(default=None, description="train LoRA adapters only (null: no adapters)")


def add_lora(model: nn.Module, settings: LoraSettings, within: nn.Module | None = None) -> None:
    """Wrap the targeted linear layers of `within` (default: `model`, the method's whole model) with adapters;
    nothing else of `model` trains (a logit bias the method adds beside `within` included), but for the parameters
    that `settings.also_train` names. A layer that a locked tower holds (it stopped training before this) keeps its
    adapter frozen at its start, where the update is zero: a locked tower ends as it began."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=settings.targets
    )
    adapted = model if within is None else within
    locked = {id(p) for p in adapted.parameters() if not p.requires_grad}
    try:
        inject_adapter_in_model(config, adapted)
    except ValueError as exc:  # no module matched
        line = str(exc).strip().splitlines()[0]
        raise ConfigError(f"config key '{KEY}.targets': {settings.targets} match no linear layer: {line}") from None
    for name, module in adapted.named_modules():
        if isinstance(module, nn.MultiheadAttention) and isinstance(module.out_proj, LoraLayer):
            raise ConfigError(
                f"config key '{KEY}.targets': {name}.out_proj is the output projection of torch's MultiheadAttention, "
                "whose forward reads its weight directly: an adapter there would never train"
            )
    adapters = [m for m in adapted.modules() if isinstance(m, LoraLayer)]
    trained = {
        id(p)
        for m in adapters
        if id(m.get_base_layer().weight) not in locked
        for name, p in m.named_parameters()
        if "lora_" in name
    }
    if adapters and not trained:
        raise ConfigError(
            f"config key '{KEY}.targets': every layer {settings.targets} adapts is in a locked tower "
            "(method.lock_image / lock_text), so no adapter would train"
        )
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in trained)
    for pattern in settings.also_train:
        named = [p for name, p in model.named_parameters() if fnmatchcase(name, pattern)]
        if not named:
            raise ConfigError(f"config key '{KEY}.also_train': {pattern!r} matches no parameter of the model")
        for parameter in named:
            parameter.requires_grad_(True)


def merge_lora(model: nn.Module) -> nn.Module:
    """`model` with every adapted layer replaced by its base layer, the update added to its weight (in place)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model


def base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict as the model without adapters names it (adapters left out)."""
    return {k.replace(".base_layer.", "."): v for k, v in module.state_dict().items() if ".lora_" not in k}


def load_base_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the weights of the model without adapters into `module` (adapted or not), strictly: every tensor but
    the adapters, which keep their initial values."""
    names = {k.replace(".base_layer.", "."): k for k in module.state_dict() if ".lora_" not in k}
    missing, extra = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or extra:
        raise RuntimeError(f"weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    module.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)

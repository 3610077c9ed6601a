"""The towers of a model, as its method declares them (`Method.tower_names`, `Method.export_towers`; the
types are `mmpt.methods.towers`'): what ONNX export writes and the model card names."""

from __future__ import annotations

from torch import nn

from mmpt.config import Config
from mmpt.methods import get_method
from mmpt.methods.towers import BATCH, SEQUENCE, TensorSpec, Tower

__all__ = ["BATCH", "SEQUENCE", "TensorSpec", "Tower", "tower_names", "towers"]


def tower_names(cfg: Config) -> tuple[str, ...]:
    """The towers `cfg`'s model has, without building it (empty: none to export)."""
    return tuple(get_method(cfg.method_name).tower_names)


def towers(model: nn.Module, cfg: Config, names: list[str] | None = None) -> list[Tower]:
    """The towers of `model` (built by `cfg`'s method, in eval mode), all or those named."""
    method = get_method(cfg.method_name)
    built = method.export_towers(model, cfg)
    found = tuple(tower.name for tower in built)
    if found != tuple(method.tower_names):
        raise RuntimeError(
            f"the '{cfg.method_name}' method's export_towers gives the towers {', '.join(found) or 'none'}; "
            f"its tower_names say {', '.join(method.tower_names) or 'none'}"
        )
    return [tower for tower in built if names is None or tower.name in names]

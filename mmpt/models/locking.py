"""Locked towers (LiT, open_clip's --lock-image / --lock-text): a tower's parameters stop training, all of them or
all but its last N groups, and its batch norm layers normalise with their running statistics and stop updating
them, as open_clip's frozen batch norm does, under the same parameter and buffer names.

A method describes each tower as its parameters in groups, ordered from input to output (`TowerGroups`): the
embeddings, one group per block, and what follows the blocks (final norm, projection). Only the parameters a
tower uses alone belong to it (the M²-Encoder's shared top layers belong to neither).
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field
from torch import nn

from mmpt.config import ConfigError, Section

TowerGroups = list[list[nn.Parameter]]  # a tower's parameters, grouped, input to output


def lock_field(tower: str):
    return Field(
        default=None,
        ge=0,
        description=f"lock the {tower} tower but its last N groups (blocks; the last group is what follows the "
        "blocks: final norm and projection); 0: all of it, batch norm statistics frozen too; null: train it",
    )


class TowerLocks(Section):
    """`method.lock_image` / `method.lock_text` of the image-text methods."""

    lock_image: int | None = lock_field("image")
    lock_text: int | None = lock_field("text")

    def locked(self) -> dict[str, int]:
        """{tower: its `lock_*` value} of the towers these keys lock: what the run summary and model card say."""
        return {tower: kept for tower in ("image", "text") if (kept := getattr(self, f"lock_{tower}")) is not None}


def layered_groups(tower: nn.Module, layers: nn.ModuleList, *after: nn.Module) -> TowerGroups:
    """`tower`'s parameters as [those registered before its first layer], one group per layer, [those after its last
    layer and the parameters of `after` (e.g. a projection outside the tower)]."""
    in_layers = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    before: list[nn.Parameter] = []
    blocks: list[list[nn.Parameter]] = [[] for _ in layers]
    rest: list[nn.Parameter] = []
    for param in tower.parameters():
        if id(param) in in_layers:
            blocks[in_layers[id(param)]].append(param)
        else:
            (rest if any(blocks) else before).append(param)
    rest += [p for module in after for p in module.parameters()]
    return [group for group in (before, *blocks, rest) if group]


def largest_layer_list(tower: nn.Module) -> nn.ModuleList:
    """The ModuleList holding most of `tower`'s parameters: its blocks, whatever the model calls them."""
    lists = [m for m in tower.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def timm_groups(tower: nn.Module, *after: nn.Module) -> TowerGroups:
    """A timm model's coarse parameter groups (stem, stages or blocks, head), as its layer-decay and open_clip's
    lock use them; `after` joins the last group."""
    from timm.models import group_parameters

    named = dict(tower.named_parameters())
    found = group_parameters(tower, tower.group_matcher(coarse=True))  # type: ignore[operator]
    groups = [[named[name] for name in names] for _, names in sorted(found.items())]
    groups[-1] += [p for module in after for p in module.parameters()]
    return groups


def lock_towers(towers: dict[str, TowerGroups], settings: TowerLocks, model: nn.Module) -> None:
    """Apply `settings` (lock_image, lock_text) to `towers` ({"image": groups, "text": groups}) of `model`."""
    for name, groups in towers.items():
        keep = getattr(settings, f"lock_{name}")
        if keep is None:
            continue
        if keep >= len(groups):
            raise ConfigError(
                f"config key 'method.lock_{name}': {keep} unlocked groups leave nothing locked (the {name} tower "
                f"has {len(groups)})"
            )
        lock(groups[: len(groups) - keep])
    freeze_locked_batch_norm(model)


def lock(groups: Iterable[list[nn.Parameter]]) -> None:
    for group in groups:
        for param in group:
            param.requires_grad_(False)


class _FrozenStatistics:
    """Mixed into a batch norm's class: it stays in evaluation mode (running statistics, not updated)."""

    def train(self, mode: bool = True):
        return super().train(False)  # type: ignore[misc]


_FROZEN: dict[type, type] = {}


def freeze_locked_batch_norm(model: nn.Module) -> None:
    """Every batch norm layer whose parameters are all locked keeps its running statistics: its class becomes a
    subclass that never enters training mode (its state dict and names unchanged)."""
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or isinstance(module, _FrozenStatistics):
            continue
        params = list(module.parameters(recurse=False))
        if not params or any(p.requires_grad for p in params):
            continue
        cls = type(module)
        frozen = _FROZEN.setdefault(cls, type(f"Frozen{cls.__name__}", (_FrozenStatistics, cls), {}))
        module.__class__ = frozen
        module.train(False)

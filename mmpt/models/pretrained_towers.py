"""Public weights for the `clip` method's towers: a timm image backbone's (timm's own pretrained weights, or a local
file) and a transformers text encoder's (any encoder checkpoint: a folder or a hub name), read the way those
libraries read them and checked before training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
import torch

from mmpt.config import ConfigError
from mmpt.errors import first_line, missing_folder

IMAGE_KEY, TEXT_KEY = "method.image.pretrained", "method.text.pretrained"
TIMM = "timm"  # `method.image.pretrained: timm`: the default pretrained tag of the timm model


def check_image_weights(timm_name: str, source: str) -> None:
    """`source` names weights timm can give `timm_name`: its own pretrained tag, or a file that exists."""
    if source == TIMM:
        if not timm.models.get_pretrained_cfg(timm_name.split(".")[0]):
            raise ConfigError(f"config key '{IMAGE_KEY}': timm has no pretrained weights for {timm_name!r}")
    elif not Path(source).expanduser().is_file():
        raise ConfigError(f"config key '{IMAGE_KEY}': {source} does not exist (a weights file, or 'timm')")


def image_weights(timm_name: str, source: str, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The backbone's state dict with those weights, as timm loads them (classifier left out, inputs adapted)."""
    overlay: dict[str, Any] = (
        {} if source == TIMM else {"pretrained_cfg_overlay": {"file": str(Path(source).expanduser())}}
    )
    try:
        model = timm.create_model(timm_name, pretrained=True, num_classes=0, **kwargs, **overlay)
    except Exception as exc:  # offline, a file of another model
        raise ConfigError(
            f"config key '{IMAGE_KEY}': cannot load {source} into {timm_name}: {first_line(exc)}"
        ) from None
    return model.state_dict()


def transformers_config(source: str, key: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of `source` (a folder, the hub cache, or a download where a network exists);
    ConfigError naming `key` where it cannot be read."""
    from transformers import AutoConfig

    if missing_folder(source):
        raise ConfigError(f"config key '{key}': {source} does not exist (a local folder, or a hub name org/name)")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # no such folder or repository, offline, remote code refused
        bare = "/" not in source and not Path(source).exists()  # a folder's typo, or a hub model
        said = f"no local folder of that name; as a hub name: {first_line(exc)}" if bare else first_line(exc)
        raise ConfigError(f"config key '{key}': cannot read a transformers config from {source}: {said}") from None


def text_config(source: str) -> Any:
    """The text encoder's transformers config."""
    return transformers_config(source, TEXT_KEY)


def text_encoder(config: Any) -> Any:
    """A randomly initialised encoder of `config`'s architecture, without a pooler where it has one (the tower
    pools itself)."""
    from transformers import AutoModel

    try:
        return AutoModel.from_config(config, add_pooling_layer=False)
    except TypeError:  # an encoder without a pooler option
        return AutoModel.from_config(config)


def text_weights(source: str, config: Any) -> dict[str, torch.Tensor]:
    """The encoder's weights as transformers loads them into `config`'s architecture, strictly."""
    from transformers import AutoModel

    try:
        try:
            loaded, info = AutoModel.from_pretrained(
                source, output_loading_info=True, dtype=torch.float32, add_pooling_layer=False
            )
        except TypeError:  # an encoder without a pooler option
            loaded, info = AutoModel.from_pretrained(source, output_loading_info=True, dtype=torch.float32)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"config key '{TEXT_KEY}': cannot load weights from {source}: {first_line(exc)}") from None
    if info["missing_keys"] or info["mismatched_keys"]:
        first = sorted(info["missing_keys"]) or [str(info["mismatched_keys"][0])]
        raise ConfigError(f"config key '{TEXT_KEY}': {source} does not fit its own config: {first[0]}")
    return loaded.state_dict()

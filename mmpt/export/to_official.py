"""`--format official`: an M²-Encoder back in the layout of the official checkpoints, so a model
continue-pretrained with mmpt goes back to the official inference code.

The reverse of `mmpt.models.m2_official` (which reads the official files): the official key order
(the model's parameter order, which `tests/data/m2_encoder_*_state_dict.tsv` records), `logit_scale`
and `logit_vl_scale` 0-D again, fp32, in a PyTorch Lightning-style checkpoint (`{"state_dict": ...}`),
the first layout the official loader and `load_official` look for. Saved with `torch.save`; nothing
but tensors in it, so `torch.load(weights_only=True)` reads it. What loading drops or changes cannot come
back: training-only visual-tokenizer weights are not in mmpt's model, and a vision position table
that loading resized to another image size stays at the model's own grid (the official loader
resizes it again for its configured size).

The folder also holds the tokenizer (the GLM `sp.model` the official code reads, or the run's
`tokenizer.json`) beside the checkpoint, as an official download has it, and `m2_encoder_arch.json`,
the architecture to configure the official code with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from mmpt.artifacts import ReleaseError, atomic_torch_save
from mmpt.config import Config
from mmpt.export.card import CARD, parameter_counts, render, training_record
from mmpt.methods import get_method
from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig
from mmpt.models.m2_official import SCALARS

if TYPE_CHECKING:
    from mmpt.methods.m2_encoder import M2Config, M2EncoderMethod

CHECKPOINT = "m2_encoder.ckpt"
ARCH = "m2_encoder_arch.json"


def official_state(state: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """mmpt weights of an M²-Encoder -> the official state dict (key order, 0-D scales, fp32)."""
    arch = cast("M2Config", cfg.method).arch
    if arch.vocab_size is None:
        arch = arch.model_copy(update={"vocab_size": state["backbone.text_embed.weight"].shape[0]})
    with torch.device("meta"):
        order = list(M2Encoder(arch).state_dict())
    missing, unexpected = sorted(set(order) - set(state)), sorted(set(state) - set(order))
    if missing or unexpected:
        raise ReleaseError(
            f"the weights do not fit the configured M2-Encoder: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    official = {}
    for key in order:
        tensor = state[key].detach().cpu()
        tensor = tensor if tensor.dtype == torch.float32 else tensor.float()
        official[key] = (tensor.reshape(()) if key in SCALARS else tensor).contiguous()
    return official


def preset_of(cfg: Config) -> str | None:
    """The named model (`mmpt.list_models()`) whose architecture this model has exactly, if any."""
    from mmpt.pretrained import MODELS

    m2 = cast("M2Config", cfg.method)
    if m2.model in MODELS and M2EncoderConfig(**PRESETS.get(m2.model)) == m2.arch:
        return m2.model
    return None


def export_official(cfg: Config, state: dict[str, torch.Tensor], files_from: Path, out: Path) -> Path:
    """Write the official-layout checkpoint of an M²-Encoder run or release, its tokenizer and architecture."""
    out.mkdir(parents=True, exist_ok=True)
    official = official_state(state, cfg)
    atomic_torch_save({"state_dict": official}, out / CHECKPOINT)
    m2 = cast("M2Config", cfg.method)
    tokenizer = cast("M2EncoderMethod", get_method(cfg.method_name)).tokenizer_file_name(cfg)
    source = files_from / tokenizer
    if not source.is_file():
        raise ReleaseError(f"{source} is missing: the model's tokenizer goes beside the checkpoint")
    if source.resolve() != (out / tokenizer).resolve():
        shutil.copyfile(source, out / tokenizer)
    arch = m2.arch.model_dump()
    arch["vocab_size"] = official["backbone.text_embed.weight"].shape[0]
    (out / ARCH).write_text(json.dumps({"preset": m2.model, **arch}, indent=2) + "\n")
    card = official_card(cfg, official, files_from, out, tokenizer)
    (out / CARD).write_text(card, encoding="utf-8")
    return out / CHECKPOINT


def official_card(cfg: Config, official: dict[str, torch.Tensor], files_from: Path, out: Path, tokenizer: str) -> str:
    preset = preset_of(cfg)
    usage = [
        "## How to use it",
        "",
        "### With the official M²-Encoder code",
        "",
        f"Point the official inference code's `load_path` at `{out}/{CHECKPOINT}` (a Lightning-style "
        f'`{{"state_dict": ...}}` checkpoint, {len(official)} tensors in the official order) and configure '
        f"it with the architecture in `{ARCH}`."
        + (" The GLM tokenizer `sp.model` is beside it." if tokenizer == "sp.model" else "")
        + (
            ""
            if tokenizer == "sp.model"
            else f" This model was trained with a WordPiece `{tokenizer}`, not the official GLM tokenizer: "
            "the official code's tokenizer does not fit it."
        ),
        "",
        "### With mmpt",
        "",
    ]
    if preset is not None and tokenizer == "sp.model":
        usage += [
            "```python",
            "import mmpt",
            f'model, _, preprocess = mmpt.create_model_and_transforms("{preset}", pretrained="{out}")',
            "```",
            "",
            "or `method.init_from: " + str(out) + "` to continue training from it.",
        ]
    else:
        usage += [f"`method.init_from: {out}` in an `m2_encoder` config with this architecture loads it (strictly)."]
    files = [
        (CHECKPOINT, "the weights in the official layout"),
        (tokenizer, "the tokenizer"),
        (ARCH, "the architecture (mmpt's `method.arch` keys)"),
        (CARD, "this card"),
    ]
    return render(
        cfg,
        title=f"{out.resolve().name}: an mmpt-trained M²-Encoder in the official checkpoint layout",
        kind="official",
        parameters=parameter_counts(cfg, files_from, official),
        record=training_record(files_from),
        usage="\n".join(usage),
        files=files,
        files_from=files_from,
    )

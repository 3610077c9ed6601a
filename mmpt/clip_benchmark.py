"""CLIP_benchmark with mmpt models, through CLIP_benchmark's own command line.

    python -m mmpt.clip_benchmark eval --model_type mmpt --pretrained runs/clip-demo \
        --dataset wds/digits --dataset_root data/digits_wds --task zeroshot_classification --no_amp

Registers the model type `mmpt` (`--pretrained`: a run or release directory, or an `hf-hub:` id;
`--model`: a free label used in output names) and hands every argument to CLIP_benchmark's CLI,
so its datasets, metrics and output files are the ones the field reports with. Needs the
`clip-benchmark` extra (`pip install -e '.[clip-benchmark]'`).

Worked around here, without touching the package (clip_benchmark 1.6.2):
- its `accuracy()` turns a one-element array into a float, which NumPy 2.4 refuses;
- its default of 4 loader workers is more than most local webdataset folders have shards
  (workers without a shard end early or fail): the default here is the folder's shard count, at most 4;
- it imports `requests` without declaring it (the extra installs it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

MODEL_TYPE = "mmpt"


class BenchmarkModel(nn.Module):
    """What CLIP_benchmark calls: `encode_image(images)` and `encode_text(tokens)`, where `tokens`
    packs token ids and attention mask as [n, 2, L]: its tokenizers return one tensor, and our text
    towers need the mask (the GLM tokenizer pads with its end-of-text id, so ids cannot tell it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        return cast(Any, self.model).encode_image(images.to(dtype), normalize=normalize)  # an image-text model

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return cast(Any, self.model).encode_text(tokens[:, 0], tokens[:, 1], normalize=normalize)


class BenchmarkTokenizer:
    """texts -> [n, 2, L] (ids, mask) with the run's own tokenizer. CLIP_benchmark passes prompts and
    captions alike, so a method's caption normalisation is not applied (`launch/zeroshot.py` applies it)."""

    def __init__(self, tokenize: Callable[[list[str]], dict[str, torch.Tensor]]):
        self.tokenize = tokenize

    def __call__(self, texts: list[str] | str) -> torch.Tensor:
        tokens = self.tokenize([texts] if isinstance(texts, str) else list(texts))
        return torch.stack([tokens["input_ids"], tokens["attention_mask"].to(tokens["input_ids"].dtype)], dim=1)


def load_mmpt(
    model_name: str, pretrained: str, cache_dir: str | None = None, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Callable, BenchmarkTokenizer]:
    """CLIP_benchmark's loader signature: (model, image transform, tokenizer) of an mmpt run or release."""
    from mmpt.artifacts import resolve
    from mmpt.methods.image_text import ImageTextMethod
    from mmpt.release import load_directory

    loaded = load_directory(resolve(pretrained), device)
    cfg, method = loaded.config, loaded.method
    if not isinstance(method, ImageTextMethod):
        raise SystemExit(f"{pretrained}: method '{cfg.method_name}' is not an image-text model")
    files = loaded.files_from
    return (
        BenchmarkModel(loaded.model).eval(),
        method.image_transform(cfg, train=False),
        BenchmarkTokenizer(method.tokenizer(cfg, files)),
    )


def top_k_accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[float]:
    """CLIP_benchmark's accuracy, computed without converting arrays to floats (NumPy >= 2.4)."""
    predicted = output.topk(max(topk), 1, True, True)[1].t()
    correct = predicted.eq(target.view(1, -1).expand_as(predicted))
    return [correct[:k].any(0).float().sum().item() / len(target) for k in topk]


def register() -> None:
    """Make `--model_type mmpt` known to CLIP_benchmark and patch its known breakages."""
    import clip_benchmark.models as models
    from clip_benchmark.metrics import zeroshot_classification

    models.TYPE2FUNC[MODEL_TYPE] = load_mmpt
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)  # the CLI's --model_type choices are this same list
    zeroshot_classification.accuracy = top_k_accuracy


def with_default_workers(argv: list[str]) -> list[str]:
    """`--num_workers` = the dataset folder's shard count (at most 4) when the user gave none."""
    if "eval" not in argv or any(a.startswith("--num_workers") for a in argv):
        return argv
    root = _value(argv, "--dataset_root")
    split = _value(argv, "--split") or "test"
    counts = Path(root or "", split, "nshards.txt")
    if root and "{" not in root and counts.is_file():
        return [*argv, "--num_workers", str(min(4, int(counts.read_text().strip())))]
    return argv


def _value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from clip_benchmark import cli
    except ImportError as exc:
        raise SystemExit(f"CLIP_benchmark is not installed ({exc}); pip install -e '.[clip-benchmark]'") from None
    register()
    sys.argv = ["clip_benchmark", *with_default_workers(argv)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())

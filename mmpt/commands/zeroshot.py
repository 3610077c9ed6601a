"""Zero-shot evaluation of a finished run, written as CLIP_benchmark-style JSON.

    python launch/zeroshot.py --model runs/clip-demo --dataset digits \
        --task zeroshot_classification --language zh --output results/

--dataset is, for classification, a CLIP_benchmark webdataset folder, an ImageFolder or a demo corpus
name (digits), or for a video model (victor) a folder of class-named clip folders; for retrieval,
any layout of mmpt/eval/retrieval_formats.py (M²-Encoder jsonl, Karpathy or ALBEF/BLIP json,
Chinese-CLIP texts jsonl + imgs tsv, CLIP_benchmark folder, webdataset shards: a .tar or a pattern such as
"held/{00000..00003}.tar", their captions where --caption-key says), or for a video model a jsonl of
{"video": path, "caption": [...]} lines, an MSR-VTT csv (video_id,sentence, e.g. the 1k-A JSFusion
list; clips in videos/ beside it), DiDeMo's json (paragraph-to-video) or the demo's held-out clips
(moving_digits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmpt.commands import installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", required=True, help="a finished run directory or a release (config + model.safetensors)"
    )
    parser.add_argument("--dataset", required=True)
    parser.add_argument(
        "--task", default="zeroshot_classification", choices=["zeroshot_classification", "zeroshot_retrieval"]
    )
    parser.add_argument("--language", default="en")
    parser.add_argument(
        "--output",
        default=".",
        help="JSON file (*.json) or folder to write the result to "
        "(default: the current folder, as <task>_<dataset>_<hash of its path>_<language>.json); "
        "the evaluated run's folder is never written",
    )
    parser.add_argument(
        "--foreign-class-names",
        action="store_true",
        help="accept class names not written in --language (e.g. English names in Chinese prompts)",
    )
    parser.add_argument(
        "--predictions",
        type=Path,
        help="retrieval: also write each caption's 10 best images to this jsonl, in Chinese-CLIP's "
        'make_topk_predictions format ({"text_id", "image_ids"} per line; MUGE\'s leaderboard reads it)',
    )
    parser.add_argument(
        "--caption-key",
        help="image-text sets read from shards: where a sample's caption is, as data.eval's caption_key "
        "(txt, json.caption_zh; comma-separated for several; default: the txt member, whatever --language says)",
    )
    parser.add_argument("--image-key", help="image-text sets read from shards: the member(s) holding the image")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)
    if args.predictions is not None and args.task != "zeroshot_retrieval":
        parser.error("--predictions is written for --task zeroshot_retrieval")
    caption_keys, image_keys = _listed(args.caption_key), _listed(args.image_key)

    from mmpt.config import ConfigError
    from mmpt.data.fields import SampleFields
    from mmpt.engine.preflight import literal_prefix
    from mmpt.eval import DEMO_SETS
    from mmpt.methods.base import ZeroShotMethod, save_eval_record
    from mmpt.methods.image_text import ImageTextMethod
    from mmpt.release import load_run

    named = args.dataset in DEMO_SETS or args.dataset == "moving_digits"
    if not named and not Path(literal_prefix(args.dataset)).exists():
        raise FileNotFoundError(
            f"--dataset {args.dataset} does not exist (a dataset folder or file, or a demo set: "
            f"{', '.join([*DEMO_SETS, 'moving_digits'])})"
        )
    cfg, method, model = load_run(args.model, device=args.device)
    if not isinstance(method, ZeroShotMethod):
        raise ConfigError(f"--model {args.model}: method '{cfg.method_name}' has no zero-shot evaluation")
    if args.predictions is not None and not isinstance(method, ImageTextMethod):
        raise ConfigError(f"--predictions: method '{cfg.method_name}' writes no image predictions")
    extra: dict = {} if args.predictions is None else {"predictions": args.predictions}
    if caption_keys or image_keys:
        if not isinstance(method, ImageTextMethod):
            raise ConfigError(f"--caption-key, --image-key: method '{cfg.method_name}' reads no image-text shards")
        try:
            extra["fields"] = SampleFields.of(caption=caption_keys, image=image_keys)
        except ValueError as exc:
            parser.error(f"--caption-key, --image-key: {exc}")
    result = method.zeroshot(
        model,
        cfg,
        Path(args.model),
        args.dataset,
        args.language,
        task=args.task,
        foreign_class_names=args.foreign_class_names,
        **extra,
    )
    print(json.dumps(result, indent=2, ensure_ascii=False))
    output = Path(args.output)
    if output.suffix == ".json":
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    else:
        output = save_eval_record(result, output)
    print(f"written to {output}", file=sys.stderr)
    return 0


def _listed(keys: str | None) -> list[str] | None:
    return None if keys is None else [key.strip() for key in keys.split(",") if key.strip()]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


run = installed(main)

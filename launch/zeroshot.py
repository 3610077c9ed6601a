"""Zero-shot evaluation of a finished run, written as CLIP_benchmark-style JSON.

    python launch/zeroshot.py --model runs/clip-demo --dataset digits \
        --task zeroshot_classification --language zh --output out.json

--dataset is, for classification, a CLIP_benchmark webdataset folder, an ImageFolder or a demo corpus
name (digits); for retrieval, a jsonl of {"image": path, "caption": [...]} lines, or for a video model
(victor) a jsonl of {"video": path, "caption": [...]} lines, an MSR-VTT-style csv (video_id,sentence;
clips in videos/ beside it) or the demo's held-out clips (moving_digits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="run directory (config.yaml + model.safetensors)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--task", default="zeroshot_classification", choices=["zeroshot_classification", "zeroshot_retrieval"])
    parser.add_argument("--language", default="en")
    parser.add_argument("--output", default=None, help="JSON file to write (default: print only)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)

    from mmpt.hub import load_run

    cfg, method, model = load_run(args.model, device=args.device)
    if not hasattr(method, "zeroshot"):
        parser.error(f"method '{cfg.method_name}' has no zero-shot classification")
    result = method.zeroshot(model, cfg, Path(args.model), args.dataset, args.language, task=args.task)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    print(text)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())

"""Build a demo corpus ahead of training.

    python launch/make_demo_data.py [--corpus digits|dialogs|moving_digits] [--root demo_data]

digits: the bilingual image-text corpus (shards, held-out zero-shot set, tokenizer) in ROOT/digits.
dialogs: the SPACE-2 dialog corpus (SPACE-2 json, unlabelled jsonl, intent CSVs, training shards) in
ROOT/dialogs.
moving_digits: the bilingual video-text corpus (mp4 shards, held-out retrieval clips, tokenizer) in
ROOT/moving_digits. Configs with `data.prepare: <corpus>` build them on first use.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=["digits", "dialogs", "moving_digits"], default="digits")
    parser.add_argument("--root", default="demo_data", help="parent directory; the corpus goes to ROOT/<corpus>")
    parser.add_argument("--image-size", type=int, default=32, help="digits only")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="digits only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.corpus == "dialogs":
        from mmpt.data.demo_dialogs import build_dialog_shards

        root = build_dialog_shards(Path(args.root) / "dialogs", seed=args.seed)
    elif args.corpus == "moving_digits":
        from mmpt.data.demo_moving_digits import build_moving_digits

        root = build_moving_digits(Path(args.root) / "moving_digits", seed=args.seed)
    else:
        from mmpt.data.demo_digits import build_digits

        root = build_digits(Path(args.root) / "digits", image_size=args.image_size,
                            test_fraction=args.test_fraction, seed=args.seed)
    print("built", root)


if __name__ == "__main__":
    main()

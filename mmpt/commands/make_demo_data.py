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

from mmpt import demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=demo.corpora(), default="digits")
    parser.add_argument("--root", default="demo_data", help="parent directory; the corpus goes to ROOT/<corpus>")
    parser.add_argument("--image-size", type=int, default=32, help="digits only")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="digits only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = {"image_size": args.image_size, "test_fraction": args.test_fraction} if args.corpus == "digits" else {}
    print("built", demo.build(args.corpus, args.root, seed=args.seed, **options))

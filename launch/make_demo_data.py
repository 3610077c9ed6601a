"""Build the bilingual digits demo corpus (image-text shards, held-out zero-shot set, tokenizer).

    python launch/make_demo_data.py [--root demo_data]

Training configs with `data.prepare: digits` build it on first use; this is for doing it ahead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmpt.data.demo_digits import build_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="demo_data", help="parent directory; the corpus goes to ROOT/digits")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = build_digits(Path(args.root) / "digits", image_size=args.image_size, test_fraction=args.test_fraction, seed=args.seed)
    print((root / "COMPLETE").read_text().strip(), "->", root)


if __name__ == "__main__":
    main()

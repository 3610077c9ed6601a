"""`python -m open_clip_train.main` with the benchmark's model config registered first (nothing else changed)."""

import sys
from pathlib import Path

import open_clip
from open_clip_train.main import main

if __name__ == "__main__":
    open_clip.add_model_config(Path(__file__).resolve().parent / "configs")
    main(sys.argv[1:])

"""`mmpt-make-image-text-shards` as a file, for a checkout: see `mmpt/commands/make_image_text_shards.py`."""

import sys

from mmpt.commands.make_image_text_shards import run

if __name__ == "__main__":
    sys.exit(run())

"""The `mmpt-make-video-shards` command as a file, for a checkout: see `mmpt/commands/make_video_shards.py`."""

import sys

from mmpt.commands.make_video_shards import run

if __name__ == "__main__":
    sys.exit(run())

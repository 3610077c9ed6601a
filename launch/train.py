"""Train a method from a config: the `mmpt-train` command as a file, for launchers that start one.

    deepspeed --num_gpus N launch/train.py --config configs/clip/demo.yaml [key.path=value ...]

Options and exit codes: `mmpt/commands/train.py`.
"""

import sys

from mmpt.commands.train import main

if __name__ == "__main__":
    sys.exit(main())

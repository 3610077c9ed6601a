"""`launch/train.py`, recording on every rank the first call of the GBA-ITC loss: the features it was
given, the loss it returned, the ranks it gathered over, where the rank runs (launcher variables and
node identity) and the weights the model had in that first step (as resumed), into
`$MMPT_RECORD_DIR/rank<R>.pt`. tests/test_multinode.py starts it under real launchers to compare each
rank's loss with a reference computed from those features.
"""

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mmpt import distributed as mdist
from mmpt.losses.grouped_itc import GroupedContrastiveLoss
from mmpt.methods.m2_encoder import M2EncoderMethod

TRAIN = Path(__file__).resolve().parents[1] / "launch/train.py"
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "CROSS_RANK",
    "CROSS_SIZE",
)
loss_forward = GroupedContrastiveLoss.forward
training_step = M2EncoderMethod.training_step
recorded = False
first_weights = None


def recording_training_step(self, model, loss, batch, pool=None, index=0):
    global first_weights
    if first_weights is None:  # whole parameters on every rank up to ZeRO-2
        first_weights = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    return training_step(self, model, loss, batch, pool, index)


def recording_forward(self, image_features, text_features, logit_scale, pool=None, slot=0):
    global recorded
    loss = loss_forward(self, image_features, text_features, logit_scale, pool, slot)
    if not recorded:
        recorded = True
        group = list(range(mdist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)
        torch.save(
            {
                "image": image_features.detach().float().cpu(),
                "text": text_features.detach().float().cpu(),
                "scale": logit_scale.detach().float().cpu(),
                "loss": loss.item(),
                "group": group,
                "node": mdist.node_identity(),
                "env": {k: os.environ.get(k) for k in LAUNCHER_VARIABLES},
                "weights": first_weights,
            },
            Path(os.environ["MMPT_RECORD_DIR"]) / f"rank{mdist.get_rank()}.pt",
        )
    return loss


if __name__ == "__main__":  # imported, it only names the variables it records (tests/test_multinode.py)
    GroupedContrastiveLoss.forward = recording_forward
    M2EncoderMethod.training_step = recording_training_step
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")

"""Turn a training run into a release directory (config.json, safetensors weights, tokenizer files).

    python launch/export.py --run runs/clip-demo --out releases/clip-demo
    python launch/export.py --run runs/m2 --checkpoint step_000002000 --out releases/m2-step2000

Without --checkpoint, the run's final model.safetensors is exported when it exists, else the newest
complete checkpoint. A checkpoint of any ZeRO stage and any number of ranks is consolidated to
fp32 (ZeRO 1-3 through DeepSpeed's zero_to_fp32, with a momentum copy's per-rank partitions put back
together; ZeRO 0 from its single model file). Checkpoints
are the run's own DeepSpeed files, read with DeepSpeed's loader; the release is safetensors only.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def consolidated_weights(run_dir: Path, tag: str) -> dict:
    """fp32 weights of the model in checkpoint `tag` (keys as the model names them)."""
    import torch

    from mmpt.config_loader import load_config

    cfg = load_config(run_dir / "config.yaml")
    root = run_dir / "checkpoints"
    if cfg.train.zero_stage == 0:
        files = sorted((root / tag).glob("mp_rank_*_model_states.pt"))
        if not files:
            raise FileNotFoundError(f"{root / tag}: no DeepSpeed model states file")
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]  # the run's own file
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from mmpt.engine.checkpoint.deepspeed_io import saved_buffers

        state: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)  # pyright: ignore[reportAssignmentType]
        # zero_to_fp32 takes buffers from rank 0's file as they are: partitioned ones are put back together
        buffers, partitioned = saved_buffers(root / tag)
        state.update({name: buffers[name] for name in partitioned})
    prefix = "model."  # the engine trains TrainingModule(model, loss); the loss holds no weights to release
    # zero_to_fp32 returns views into one flat buffer: own copies, so safetensors sees no shared storage
    return {k[len(prefix) :]: v.float().clone() for k, v in state.items() if k.startswith(prefix)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="training run directory")
    parser.add_argument("--out", required=True, help="release directory to write")
    parser.add_argument("--checkpoint", default=None, help="checkpoint tag (step_NNNNNNNNN) or 'latest'")
    parser.add_argument("--max-shard-size", default="2GB", help="weights are split into files of at most this size")
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    from mmpt.engine.checkpoint import find_resume
    from mmpt.release import read_config, save_release

    run_dir = Path(args.run)
    cfg = read_config(run_dir)
    if args.checkpoint is None and (run_dir / "model.safetensors").is_file():
        state, origin = load_file(str(run_dir / "model.safetensors")), "model.safetensors"
    else:
        checkpoint = (
            find_resume(run_dir, "auto")
            if args.checkpoint in (None, "latest")
            else run_dir / "checkpoints" / args.checkpoint
        )
        if checkpoint is None or not checkpoint.is_dir():
            parser.error(f"{run_dir}: no {'complete checkpoint' if checkpoint is None else checkpoint} to export")
        state, origin = consolidated_weights(run_dir, checkpoint.name), checkpoint.name
    out = save_release(args.out, cfg, state, run_dir, max_shard_size=args.max_shard_size)
    print(f"exported {run_dir} ({origin}) -> {out}")
    return 0


def run() -> int:
    """The installed command: an expected error ends in one line and its exit code (`mmpt.cli`)."""
    from mmpt import cli

    return cli.run(main)

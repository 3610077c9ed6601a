"""Turn a training run into a release directory (config.json, safetensors weights, tokenizer files, model card),
or export a run or release to a format other tools load.

    python launch/export.py --run runs/clip-demo --out releases/clip-demo
    python launch/export.py --run runs/m2 --checkpoint step_000002000 --out releases/m2-step2000
    python launch/export.py --run releases/clip-demo --out exports/clip-demo-onnx --format onnx
    python launch/export.py --run releases/clip-demo --out exports/clip-demo-open_clip --format open_clip
    python launch/export.py --run runs/m2 --out exports/m2-official --format official
    python launch/export.py --run runs/clip-finetune --out exports/clip-finetune-hf --format transformers

--format: release (the default: an mmpt release), onnx (one ONNX file per tower, preprocessing.json with
the input contract, the tokenizer files), open_clip (a model config and state dict open_clip loads; clip
and open_clip models), official (the official M2-Encoder checkpoint layout), transformers (a folder
transformers.AutoModel.from_pretrained loads, with its tokenizer and image processor). Every folder gets a model
card (README.md). A format the model does not support, or a tower it does not have (--towers), is a
one-line error (exit 2), found before any weight is read. A model of a method defined outside mmpt
exports the same way: `--import MODULE` registers its method first.

Without --checkpoint, the run's final model.safetensors is exported when it exists (a release's weights,
sharded or not, likewise), else the newest complete checkpoint. A checkpoint of any ZeRO stage and any
number of ranks is consolidated to fp32 (ZeRO 1-3 through DeepSpeed's zero_to_fp32, and bf16 at ZeRO-1, whose
files it refuses, through `deepspeed_io.fp32_weights`; a momentum copy's per-rank partitions put back
together; ZeRO 0 from its single model file). Checkpoints
are the run's own DeepSpeed files, read with DeepSpeed's loader; the release is safetensors only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmpt.commands import add_import_option, import_modules, installed


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
        from mmpt.engine.checkpoint.deepspeed_io import fp32_weights, saved_buffers

        state = fp32_weights(root / tag)
        # zero_to_fp32 takes buffers from rank 0's file as they are: partitioned ones are put back together
        module, partitioned = saved_buffers(root / tag)
        state.update({name: module[name] for name in partitioned})
        if cfg.train.zero_stage < 3:  # frozen parameters have no master copy; ZeRO-1/2 save them whole
            state.update({name: value for name, value in module.items() if name not in state})
    prefix = "model."  # the engine trains TrainingModule(model, loss); the loss holds no weights to release
    # zero_to_fp32 returns views into one flat buffer: own copies, so safetensors sees no shared storage
    return {k[len(prefix) :]: v.float().clone() for k, v in state.items() if k.startswith(prefix)}


def adapters_merged(cfg, state: dict, files_from: Path):
    """(`cfg` without `method.lora`, `state` with the adapters folded into the weights): the base architecture."""
    from mmpt.models.lora import merge_lora
    from mmpt.release import built_model

    model = merge_lora(built_model(cfg, state, files_from).model)
    merged = cfg.model_copy(deep=True)
    merged.method.lora = None  # only methods with a `lora` key get here
    return merged, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    from mmpt.export.formats import FORMATS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="training run or release directory")
    parser.add_argument("--out", required=True, help="directory to write")
    add_import_option(parser, "the run")
    parser.add_argument("--format", default="release", help=f"one of {', '.join(FORMATS)} (default: release)")
    parser.add_argument(
        "--towers", default=None, help="with --format onnx: the towers to export, comma-separated (default: all)"
    )
    parser.add_argument("--checkpoint", default=None, help="checkpoint tag (step_NNNNNNNNN) or 'latest'")
    parser.add_argument("--max-shard-size", default="2GB", help="weights are split into files of at most this size")
    parser.add_argument(
        "--keep-lora",
        action="store_true",
        help="a run with LoRA adapters: keep them in the export (default: as method.lora.merge_on_export says)",
    )
    parser.add_argument(
        "--skip-check",
        action="store_true",
        help="onnx, open_clip and transformers: do not load the written files back and compare their outputs with "
        "mmpt's",
    )
    args = parser.parse_args(argv)

    from mmpt.artifacts import ReleaseError, has_weights
    from mmpt.config import ConfigError
    from mmpt.engine.checkpoint import find_resume
    from mmpt.export.formats import check_export
    from mmpt.models.tensor_files import read_safetensors
    from mmpt.release import built_model, read_config, save_release

    import_modules(args.imports)
    run_dir, out = Path(args.run), Path(args.out)
    cfg = read_config(run_dir)
    towers = check_export(cfg, args.format, args.towers)  # before any weight is read
    if args.format == "onnx":
        from mmpt.export.to_onnx import missing_packages

        if missing := missing_packages(check=not args.skip_check):
            raise ConfigError(f"--format onnx needs {', '.join(missing)}: pip install -e '.[onnx]'")
    if args.checkpoint is None and has_weights(run_dir):
        state, origin = read_safetensors(run_dir), "model.safetensors"
    else:
        checkpoint = (
            find_resume(run_dir, "auto")
            if args.checkpoint in (None, "latest")
            else run_dir / "checkpoints" / args.checkpoint
        )
        if checkpoint is None or not checkpoint.is_dir():
            what = "complete checkpoint" if args.checkpoint else "model.safetensors and no complete checkpoint"
            raise ReleaseError(f"{run_dir}: no {what if checkpoint is None else checkpoint} to export")
        state, origin = consolidated_weights(run_dir, checkpoint.name), checkpoint.name
    lora = getattr(cfg.method, "lora", None)
    if lora is not None and lora.merge_on_export and not args.keep_lora:
        cfg, state = adapters_merged(cfg, state, run_dir)
    elif lora is not None and args.format == "transformers":
        raise ConfigError("--format transformers writes the base architecture: LoRA adapters are folded in there")
    if args.format == "release":
        written = save_release(out, cfg, state, run_dir, max_shard_size=args.max_shard_size)
    elif args.format == "official":
        from mmpt.export.to_official import export_official

        written = export_official(cfg, state, run_dir, out)
    elif args.format == "onnx":
        from mmpt.export.to_onnx import export_onnx

        files = export_onnx(built_model(cfg, state, run_dir), out, towers, check=not args.skip_check)
        written = f"{out} ({', '.join(path.name for path in files)})"
    elif args.format == "transformers":
        from mmpt.export.to_transformers import export_transformers

        written = export_transformers(built_model(cfg, state, run_dir), out, check=not args.skip_check)
    else:
        from mmpt.export.to_open_clip import export_open_clip

        written = export_open_clip(built_model(cfg, state, run_dir), out, check=not args.skip_check)
    print(f"exported {run_dir} ({origin}) as {args.format} -> {written}")
    return 0


run = installed(main)

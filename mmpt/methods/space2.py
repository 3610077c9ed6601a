"""`space2`: tree-structured semi-supervised contrastive dialog pretraining (SPACE-2, COLING 2022).

A batch is one sub-batch per source (`data.train.compose: per_source`), e.g. a labelled and an
unlabelled one. Every sub-batch is encoded twice with dropout; its contrastive loss weighs pairs by
the semantic-tree score of their labels, per view, over all ranks' examples (so the unlabelled
sub-batch, whose labels are empty, gets the self-supervised loss), and its MLM loss predicts value
spans or 15% random tokens. The step loss is the sum over sub-batches of contrastive + mlm_weight x MLM,
as in the released `semi` setting. Terms are logged per sub-batch.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

import torch
from pydantic import Field
from torch import nn

from mmpt.config import Config, EvalSetConfig, Section
from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec, collate_dialogs
from mmpt.data.loader import BatchStream
from mmpt.data.shards import DataError
from mmpt.losses.mlm import masked_lm_loss
from mmpt.losses.tree_contrastive import TreeContrastiveLoss
from mmpt.losses.tree_score import MAX_LABEL_ELEMENTS, VIEWS, LabelCodes
from mmpt.methods import register
from mmpt.methods.base import EngineNeeds, Method, MethodConfig, eval_record, refuse_several_languages, stream_spec
from mmpt.methods.towers import BATCH, SEQUENCE, DialogTower, TensorSpec, Tower, features, with_output_dims
from mmpt.models.space2 import TURN_ROWS, Space2Encoder

BACKBONE_DIR = "encoder"  # the backbone's config and tokenizer files inside a run directory
BACKBONE_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ENCODER_INPUTS = ("input_ids", "positions", "turns", "roles", "attention_mask")  # what the encoder reads of a batch
View = Literal["D", "I", "S", "V", "DI", "IS", "SV", "DIS", "ISV", "DISV"]


def resolve_encoder_path(spec: str) -> Path:
    """A local HF checkpoint directory, or `pkg:<module>/<subdir>` for one shipped inside a Python package."""
    if spec.startswith("pkg:"):
        module, _, sub = spec[4:].partition("/")
        try:
            return Path(str(resources.files(module))) / sub
        except ModuleNotFoundError:
            raise FileNotFoundError(
                f"config key 'method.encoder': Python package {module!r} is not installed "
                f"(pip install {module.replace('_', '-')})"
            ) from None
    return Path(spec)


class IntentEvalConfig(Section):
    """The protocol of the `data.eval` intent sets (folders with train.csv and test.csv, or 'dialogs')."""

    shots: list[int] = Field(default_factory=lambda: [10], description="k-shot settings (k examples per intent)")
    full: bool = Field(default=True, description="also train the head on all training examples")
    seeds: int = Field(default=3, gt=0, description="k-shot draws (and head seeds) averaged")
    finetune_epochs: int = Field(
        default=0,
        ge=0,
        description="also fine-tune the whole encoder per setting for this many "
        "epochs (the SPACE-2/DialoGLUE protocol); 0: linear probe only",
    )
    batch_size: int = Field(default=64, gt=0)


class Space2Config(MethodConfig):
    name: Literal["space2"] = "space2"
    encoder: str = Field(description="local Hugging Face BERT-family checkpoint dir, or pkg:<module>/<subdir>")
    dropout: float = Field(
        default=0.2, ge=0, lt=1, description="dropout everywhere in the encoder (makes the two views)"
    )
    views: list[View] = Field(
        default_factory=lambda: cast(list[View], list(VIEWS)), min_length=1, description="tree views trained"
    )
    project: bool = Field(
        default=True, description="per-view projection heads (with_project); false: CLS + combined score"
    )
    subspace_dim: int | None = Field(
        default=None, gt=0, description="width of each view's projection (default: hidden)"
    )
    temperature: float = Field(default=0.07, gt=0)
    mlm_weight: float = Field(default=0.1, ge=0, description="mlm_ratio: weight of the MLM term")
    supervised: bool = Field(
        default=True, description="false: labels ignored, every batch self-supervised (SimCSE-style)"
    )
    max_utt_len: int = Field(default=50, gt=0, description="word pieces kept per utterance (its last ones)")
    max_turns: int = Field(default=16, gt=0, le=16, description="utterances kept per example (the last ones)")
    max_len: int = Field(default=256, gt=0, description="tokens kept per example (the last ones)")
    mlm_probability: float = Field(default=0.15, ge=0, le=1)
    max_label_elements: int = Field(
        default=MAX_LABEL_ELEMENTS,
        gt=0,
        description="elements per tree view a label may have "
        "(labels travel as fixed-size tensors; a dialog with more is skipped and counted)",
    )
    intent_eval: IntentEvalConfig = Field(default_factory=IntentEvalConfig)


class Space2Loss(nn.Module):
    """The loss settings a training step needs: the tree contrastive loss, the MLM weight, label use."""

    def __init__(self, contrastive: TreeContrastiveLoss, mlm_weight: float, supervised: bool):
        super().__init__()
        self.contrastive, self.mlm_weight, self.supervised = contrastive, mlm_weight, supervised


class Space2Method(Method[Space2Config]):
    name = "space2"
    config_class = Space2Config
    tiny_overrides = (
        'data.train.sources=[{{name: labelled, shards: "{dialogs}/shards/labelled-*.tar"}}, '
        '{{name: unlabelled, shards: "{dialogs}/shards/unlabelled-*.tar"}}]',
        "method.encoder={bert}",
        "method.max_len=64",
        "method.max_turns=4",
        "method.max_utt_len=16",
        "method.intent_eval.shots=[2]",
        "method.intent_eval.seeds=1",
        'data.eval=[{{dataset: "{dialogs}/intent", task: intent}}]',
    )

    def check_config(self, cfg: Config) -> None:
        if not self.settings(cfg).project and len(self.settings(cfg).views) != 1:
            raise ValueError("method.project = false uses the combined tree score: set method.views to one entry")
        for index, eval_set in enumerate(cfg.data.eval):
            refuse_several_languages(index, eval_set, ": an intent set is evaluated once, in its own language")

    def prepare(self, cfg: Config, run_dir: Path) -> None:
        source = resolve_encoder_path(self.settings(cfg).encoder)
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"config key 'method.encoder': {source} is not a Hugging Face checkpoint directory")
        target = run_dir / BACKBONE_DIR
        target.mkdir(parents=True, exist_ok=True)
        for name in BACKBONE_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, target / name)

    def release_files(self, cfg: Config) -> list[str]:
        return [BACKBONE_DIR]

    def preprocessors(self, cfg: Config, run_dir: Path) -> dict[str, Any]:
        """The tokenizer turns dialogs (lists of {"role", "text"} turns, the last one current) into a batch."""
        return {"tokenizer": DialogEncoder(self.tokenizer(run_dir), self.input_spec(cfg), with_mlm=False)}

    def tokenizer(self, run_dir: Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(run_dir) / BACKBONE_DIR)

    def input_spec(self, cfg: Config) -> DialogInputSpec:
        m = self.settings(cfg)
        return DialogInputSpec(m.max_utt_len, m.max_turns, m.max_len, m.mlm_probability, m.max_label_elements)

    def build_model(self, cfg: Config, run_dir: Path) -> Space2Encoder:
        m = self.settings(cfg)
        return Space2Encoder.from_backbone_dir(
            str(run_dir / BACKBONE_DIR), subspace_dim=m.subspace_dim, dropout=m.dropout
        )

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        return {"method.encoder": str(resolve_encoder_path(self.settings(cfg).encoder))}

    def load_initial_weights(self, model: Space2Encoder, cfg: Config) -> str:
        path = resolve_encoder_path(self.settings(cfg).encoder)
        model.load_backbone(str(path))
        return f"dialog encoder from {path} (the SPACE-2 heads new)"

    def build_loss(self, cfg: Config) -> Space2Loss:
        m = self.settings(cfg)
        contrastive = TreeContrastiveLoss(
            [VIEWS.index(v) for v in m.views], combined=not m.project, temperature=m.temperature
        )
        return Space2Loss(contrastive, m.mlm_weight, m.supervised)

    def engine_needs(self, model: Space2Encoder, cfg: Config) -> EngineNeeds:
        return EngineNeeds(compilable=(model.backbone.encoder,))  # the dialog encoder's transformer layers

    # --- export ---

    tower_names = ("dialog",)
    intended_use = (
        "Dialog representations: intent classification with a small labelled set (linear probe or fine-tuning), "
        "dialog retrieval and clustering, in the language and the domains of its training dialogs "
    )

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        encoder, m = cast(Space2Encoder, model), self.settings(cfg)
        vocab = int(getattr(encoder.config, "vocab_size"))  # noqa: B009 (BERT-family configs have it; the base class not)
        shape = (BATCH, SEQUENCE)
        inputs = (
            TensorSpec("input_ids", "int64", shape, "word-piece ids with role tokens", (0, vocab)),
            TensorSpec(
                "positions", "int64", shape, "position within each utterance (restarts at 0)", (0, m.max_utt_len + 2)
            ),
            TensorSpec(
                "turns", "int64", shape, "turn distance from the current utterance (1 = current)", (1, TURN_ROWS)
            ),
            TensorSpec("roles", "int64", shape, "role id (0 or 1, alternating back from the current turn)", (0, 2)),
            TensorSpec("attention_mask", "int64", shape, "1 for real tokens, 0 for padding"),
        )
        dialog = DialogTower(encoder, lambda model_, batch: model_.encode_dialog(batch))
        return with_output_dims([Tower("dialog", dialog, inputs, features("dialog"), max_sequence=m.max_len)])

    def input_contract(self, cfg: Config, run_dir: Path, out: Path) -> dict[str, Any]:
        """The dialog tokenizer: the backbone's tokenizer files, copied into `out`/tokenizer, and the rules."""
        target = out / "tokenizer"
        target.mkdir(exist_ok=True)
        copied = []
        for name in BACKBONE_FILES:
            source = run_dir / BACKBONE_DIR / name
            if name != "config.json" and source.is_file():
                shutil.copyfile(source, target / name)
                copied.append(f"tokenizer/{name}")
        spec = self.input_spec(cfg)
        return {
            "tokenizer": {
                "kind": "space2-dialog",
                "files": copied,
                "max_utt_len": spec.max_utt_len,
                "max_turns": spec.max_turns,
                "max_len": spec.max_len,
                "about": "a dialog (list of {role, text} turns, the last one current) as SPACE-2 encodes it: per "
                "utterance the word pieces (its last max_utt_len), wrapped in role tokens ([unused12] ... [unused6] "
                "for the user, [unused13] ... [unused7] otherwise); positions restart per utterance; turns count "
                "back from the current utterance (1); roles alternate back from it; the last max_turns utterances "
                "and the last max_len tokens kept; batches right-padded with 0. "
                "mmpt.data.dialog_encoding.DialogEncoder implements it (its attention_mask is bool: cast to int64)",
            }
        }

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        views = len(self.settings(cfg).views)
        backbone = run_dir / BACKBONE_DIR / "config.json"
        detail = ""
        if backbone.is_file():
            b = json.loads(backbone.read_text())
            detail = (
                f" ({b.get('model_type', 'BERT')}: {b.get('num_hidden_layers')} layers, width "
                f"{b.get('hidden_size')}, {b.get('num_attention_heads')} heads)"
            )
        return (
            f"SPACE-2 dialog encoder on a Hugging Face BERT-family backbone{detail}, with turn and role "
            f"embeddings and {views} tree-view projection heads; the dialog feature is the CLS state, "
            "L2-normalised"
        )

    def train_data(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int) -> BatchStream:
        encoder = DialogEncoder(self.tokenizer(run_dir), self.input_spec(cfg))
        return BatchStream(stream_spec(cfg, rank=rank, world_size=world_size), encoder, collate_dialogs)

    def training_step(
        self, model: Space2Encoder, loss: Space2Loss, batch: dict[str, Any], pool: Any = None, index: int = 0
    ) -> dict[str, torch.Tensor]:
        groups = {"batch": batch} if "input_ids" in batch else batch
        terms = {}
        for name, group in groups.items():
            labels = LabelCodes(group["label_views"], group["label_frame"])
            if not loss.supervised:  # every example unlabelled
                labels = LabelCodes(torch.zeros_like(labels.views), torch.zeros_like(labels.frames))
            terms[f"{name}/contrastive"] = self.contrastive(model, loss.contrastive, group, labels)
            logits, targets = model.mlm_logits(group)
            terms[f"{name}/mlm"] = loss.mlm_weight * masked_lm_loss(logits, targets)
        return terms

    @staticmethod
    def contrastive(
        model: Space2Encoder, loss: TreeContrastiveLoss, group: dict[str, Any], labels: LabelCodes
    ) -> torch.Tensor:
        """Both dropout copies in one pass (the batch concatenated with itself), then the tree-scored loss."""
        n = group["input_ids"].shape[0]
        doubled = {k: torch.cat([group[k], group[k]]) for k in ENCODER_INPUTS}
        if loss.combined:
            features = model.dialog_vector(doubled)[:, None]
        else:
            views = model.view_features(doubled)
            # one slice per view: a list as an index would be copied to the device from host memory each step
            features = torch.stack([views[:, v] for v in loss.views], dim=1)
        features = torch.stack([features[:n], features[n:]], dim=1)  # [n, 2, K, d]
        return loss(features, labels)

    eval_tasks = ("intent",)

    def evaluate_set(
        self, model: Space2Encoder, cfg: Config, run_dir: Path, eval_set, language: str, final: bool
    ) -> dict[str, Any]:
        """`method.intent_eval`'s probe on the set; at the end of training also its fine-tuning, where configured
        (one run per setting: the costly protocol)."""
        from mmpt.eval.intent import FineTuning, intent_classification, resolve_intent_dataset

        ev = self.settings(cfg).intent_eval
        encoder = DialogEncoder(self.tokenizer(run_dir), self.input_spec(cfg), with_mlm=False)
        result = intent_classification(
            model,
            encoder,
            resolve_intent_dataset(eval_set.dataset, cfg.data.root),
            shots=ev.shots,
            full=ev.full,
            seeds=ev.seeds,
            batch_size=ev.batch_size,
            finetune=FineTuning(epochs=ev.finetune_epochs) if final and ev.finetune_epochs else None,
        )
        return {**result, **eval_record(run_dir, eval_set.dataset, eval_set.task, language, result["metrics"])}

    def check_eval_set(self, cfg: Config, eval_set: EvalSetConfig) -> None:
        """The intent folder's train.csv and test.csv read (and val.csv where there is one)."""
        from mmpt.data.dialog import read_intent_csv
        from mmpt.eval.intent import resolve_intent_dataset

        folder = resolve_intent_dataset(eval_set.dataset)
        for split in ("train.csv", "test.csv", "val.csv"):
            if (folder / split).is_file() and not read_intent_csv(folder / split):
                raise DataError(f"{folder / split} has no rows")


METHOD = register(Space2Method())

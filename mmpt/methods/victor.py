"""`victor`: video-language pretraining with contrastive proxy tasks (VICTOR, ACM MM 2021).

One batch is B clips of T frames with one sentence each. A step runs:
1. the query frame encoder once, and the momentum key network on the clean clip and sentence;
2. dual-VSA: pooled video and text queries against the key network's pooled features of their pair,
   the other modality's memory queue as negatives;
3. one cross-modal pass over the masked (MLM), segment-shuffled (MSOM) sentence and the clip with
   masked frames (intra- and inter-MFM);
4. one cross-modal pass over the clean sentence and the segment-shuffled clip (MFOM);
then enqueues the key features (every rank's) into the three queues. Each task has a weight in
`method.tasks`; 0 turns it off and skips its computation. Every term is logged on its own.

What the paper states and what is our design is listed in docs/victor.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

import torch
from pydantic import Field
from torch import nn

from mmpt.config import Config, EvalSetConfig, Section
from mmpt.data.loader import BatchStream
from mmpt.data.shards import DataError
from mmpt.data.tokenizer import TextTokenizer
from mmpt.data.video import Backend, ResizeCenterCrop, VideoTextDecoder
from mmpt.losses.memory_queue import MemoryQueue
from mmpt.losses.mlm import masked_lm_loss
from mmpt.losses.victor import (
    IGNORE,
    dual_vsa_loss,
    inter_mfm_loss,
    intra_mfm_loss,
    mask_frames,
    mask_tokens,
    order_loss,
    permute_frames,
    permute_sentences,
    random_permutations,
)
from mmpt.methods import register
from mmpt.methods.base import (
    EngineNeeds,
    Method,
    MethodConfig,
    copy_tokenizer,
    count,
    eval_record,
    refuse_several_languages,
    stream_spec,
)
from mmpt.methods.towers import (
    BATCH,
    SEQUENCE,
    TensorSpec,
    TextTower,
    Tower,
    VideoTower,
    features,
    text_inputs,
    with_output_dims,
)
from mmpt.models.clip import TextTowerConfig
from mmpt.models.victor import UnimodalTowers, VictorModel, VideoTowerConfig, load_backbone_weights

TOKENIZER_FILE = "tokenizer.json"


class TaskWeights(Section):
    """Weight of each proxy task in the total loss; 0 turns the task off."""

    mlm: float = Field(default=1.0, ge=0, description="masked language modelling")
    msom: float = Field(default=1.0, ge=0, description="masked sentence order modelling (6-way)")
    mfom: float = Field(default=1.0, ge=0, description="masked frame order modelling (6-way) [ours]")
    intra_mfm: float = Field(default=1.0, ge=0, description="masked frame vs the clip's own frames")
    inter_mfm: float = Field(default=1.0, ge=0, description="masked frame vs key frame, frames queue negatives")
    dual_vsa: float = Field(default=1.0, ge=0, description="dual video-sentence alignment against the memory queues")


class RetrievalEvalConfig(Section):
    """How the `data.eval` sets (retrieval listings, classification folders) are read."""

    video_root: str | None = Field(
        default=None,
        description="folder a retrieval listing's videos are in: a csv's <video_id>.mp4 (default: videos/ beside it), "
        "a jsonl's relative paths or ids not found beside it",
    )
    batch_size: int = Field(default=64, gt=0)


class VictorConfig(MethodConfig):
    name: Literal["victor"] = "victor"
    tokenizer: str = Field(description="path of a `tokenizers` tokenizer.json (copied into the run directory)")
    video: VideoTowerConfig = Field(default_factory=VideoTowerConfig)
    text: TextTowerConfig = Field(default_factory=TextTowerConfig)
    embed_dim: int = Field(default=256, gt=0, description="width of the pooled (retrieval) features")
    cross_layers: int = Field(default=2, gt=0, description="cross-modal transformer layers (text width and heads)")
    tasks: TaskWeights = Field(default_factory=TaskWeights)
    momentum: float = Field(default=0.995, ge=0, le=1, description="m of the key network's EMA update")
    queue_size: int = Field(default=4096, gt=0, description="entries of the visual and textual queues")
    frame_queue_size: int = Field(default=4096, gt=0, description="entries (single frames) of the frames queue")
    vsa_temperature: float = Field(default=0.07, gt=0, description="dual-VSA temperature (initial value if learned)")
    learn_temperature: bool = Field(default=True, description="learn the dual-VSA temperature")
    mfm_temperature: float = Field(default=0.07, gt=0, description="temperature of intra- and inter-MFM")
    mlm_probability: float = Field(default=0.15, gt=0, lt=1)
    frame_mask_ratio: float = Field(default=0.15, gt=0, lt=1, description="frames masked per clip (at least one)")
    backend: Backend | None = Field(
        default=None, description="video decoder: decord or pyav (default: decord on x86_64)"
    )
    min_frames: int = Field(default=1, gt=0, description="shorter videos are skipped and counted")
    retrieval: RetrievalEvalConfig = Field(default_factory=RetrievalEvalConfig)


class VictorLoss(nn.Module):
    """The loss state of a run: task weights, corruption settings, and the three memory queues
    (buffers, so the engine saves and restores them with every checkpoint)."""

    def __init__(self, cfg: VictorConfig, mask_id: int, vocab_size: int):
        super().__init__()
        self.weights = cfg.tasks
        self.mask_id, self.vocab_size = mask_id, vocab_size
        self.mlm_probability, self.frame_mask_ratio = cfg.mlm_probability, cfg.frame_mask_ratio
        self.mfm_temperature = cfg.mfm_temperature
        self.video_queue = MemoryQueue(cfg.queue_size, cfg.embed_dim)
        self.text_queue = MemoryQueue(cfg.queue_size, cfg.embed_dim)
        self.frame_queue = MemoryQueue(cfg.frame_queue_size, cfg.video.width)


class VictorMethod(Method[VictorConfig]):
    name = "victor"
    config_class = VictorConfig
    tower_switches = "method.video"
    tiny_overrides = (
        'data.train.sources=[{{shards: "{video}/train/en-*.tar"}}, {{shards: "{video}/train/zh-*.tar"}}]',
        "method.tokenizer={video}/tokenizer.json",
        "method.video.backbone=resnet10t",
        "method.video.backbone_weights=null",
        "method.video.image_size=32",
        "method.video.num_frames=4",
        "method.video.width=32",
        "method.video.layers=1",
        "method.video.heads=2",
        "method.text.width=32",
        "method.text.layers=1",
        "method.text.heads=2",
        "method.text.context_length=24",
        "method.text.vocab_size=null",
        "method.embed_dim=16",
        "method.cross_layers=1",
        "method.queue_size=16",
        "method.frame_queue_size=32",
        "method.backend=pyav",
        "method.retrieval.video_root=null",
        'data.eval=[{{dataset: "{video}/test/retrieval_en.jsonl", task: zeroshot_retrieval}}]',
    )
    sample_fields = ("caption", "video")
    eval_tasks = ("zeroshot_classification", "zeroshot_retrieval")

    def evaluate_set(
        self, model: VictorModel, cfg: Config, run_dir: Path, eval_set, language: str, final: bool
    ) -> dict[str, Any]:
        return self.zeroshot(
            model, cfg, run_dir, eval_set.dataset, language, eval_set.task, eval_set.foreign_class_names
        )

    def check_config(self, cfg: Config) -> None:
        m = self.settings(cfg)
        if not any(m.tasks.model_dump().values()):
            raise ValueError("method.tasks: every task weight is 0; turn at least one task on")
        if m.text.pretrained is not None:
            raise ValueError(
                "method.text.pretrained: the victor method builds its text tower as a new BERT of method.text's size "
                "with method.tokenizer; it reads no text checkpoint (remove the key)"
            )
        for index, eval_set in enumerate(cfg.data.eval):
            if eval_set.task == "zeroshot_retrieval" and eval_set.dataset != "moving_digits":
                why = f" choose the moving_digits demo's caption files; {eval_set.dataset} is evaluated once"
                refuse_several_languages(index, eval_set, why)

    def check_eval_set(self, cfg: Config, eval_set: EvalSetConfig) -> None:
        """A retrieval listing read and its videos found, a classification folder's class names read; no video
        is decoded."""
        from mmpt.eval.video_classification import load_video_classification_set
        from mmpt.eval.video_retrieval import load_video_retrieval_set

        video_root = self.settings(cfg).retrieval.video_root
        if eval_set.task == "zeroshot_classification":
            for language in eval_set.languages:
                load_video_classification_set(eval_set.dataset, language, eval_set.foreign_class_names)
            return
        try:
            load_video_retrieval_set(eval_set.dataset, video_root)
        except DataError as exc:
            if "not found" in str(exc) and not video_root:
                raise DataError(f"{exc} (set method.retrieval.video_root to the folder of the clips)") from None
            raise

    def prepare(self, cfg: Config, run_dir: Path) -> None:
        copy_tokenizer(run_dir, TOKENIZER_FILE, self.settings(cfg).tokenizer)

    def release_files(self, cfg: Config) -> list[str]:
        return [TOKENIZER_FILE]

    def tokenizer(self, cfg: Config, run_dir: Path) -> TextTokenizer:
        return TextTokenizer(Path(run_dir) / TOKENIZER_FILE, self.settings(cfg).text.context_length)

    def video_decoder(self, cfg: Config, run_dir: Path, train: bool) -> VideoTextDecoder:
        """Frames resized and centre-cropped, the same way for training and evaluation: no flips, since the
        direction of motion is what captions describe. They stay uint8; the model normalises them."""
        m = self.settings(cfg)
        return VideoTextDecoder(
            m.video.num_frames,
            None,
            self.tokenizer(cfg, run_dir),
            backend=m.backend,
            train=train,
            min_frames=m.min_frames,
            clip_transform=ResizeCenterCrop(m.video.image_size),
            features_field="npy" if m.video.backbone is None else None,
        )

    def preprocessors(self, cfg: Config, run_dir: Path) -> dict[str, Any]:
        """ "tokenizer" (texts -> ids and mask) and "video" (video bytes -> the model's uint8 [T, 3, H, W]
        input: the middle frame of each of T segments, resized and centre-cropped)."""
        return {
            "tokenizer": self.tokenizer(cfg, run_dir),
            "video": self.video_decoder(cfg, run_dir, train=False).decode_video,
        }

    def build_model(self, cfg: Config, run_dir: Path) -> VictorModel:
        m = self.settings(cfg)
        text = m.text
        if text.vocab_size is None:
            text = text.model_copy(update={"vocab_size": self.tokenizer(cfg, run_dir).vocab_size})
        return VictorModel(
            m.video,
            text,
            m.embed_dim,
            m.cross_layers,
            m.momentum,
            m.vsa_temperature,
            m.learn_temperature,
            tasks=[name for name, w in m.tasks.model_dump().items() if w],
        )

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        m = self.settings(cfg)
        listings = any(e.task == "zeroshot_retrieval" and e.dataset != "moving_digits" for e in cfg.data.eval)
        return {
            "method.tokenizer": m.tokenizer,
            "method.video.backbone_weights": m.video.backbone_weights,
            "method.retrieval.video_root": m.retrieval.video_root if listings else None,  # read only with a listing
        }

    def load_initial_weights(self, model: VictorModel, cfg: Config) -> str | None:
        weights = self.settings(cfg).video.backbone_weights
        backbone = model.unimodal.frame_encoder.backbone
        if not weights or backbone is None:  # a features model has no backbone (its config refuses weights)
            return None
        load_backbone_weights(backbone, weights)
        model.key.reset()  # the key network starts from the loaded weights too
        return f"frame backbone from {weights} (the rest new)"

    def engine_needs(self, model: VictorModel, cfg: Config) -> EngineNeeds:
        # The key network is an EMA with m close to 1: an update moves a weight by (1 - m) of its distance
        # to the query weight, below bf16's resolution for most steps. As a momentum copy the engine keeps
        # it fp32, updates it from the query towers after every optimizer step, and shards it under ZeRO-3.
        # The projection heads' batch norm centres features over the batch (see `Projection`): over the
        # global batch, so the features, and the running statistics saved on rank 0, do not depend on how
        # the batch is split into ranks.
        # The temporal and cross-modal transformers (query and key) are what grows with frames x tokens.
        key_towers = cast(UnimodalTowers, model.key.network)  # the key network is a copy of the query towers
        transformers = [model.unimodal.temporal.encoder, key_towers.temporal.encoder]
        if model.cross is not None:
            transformers.append(model.cross.encoder)
        # Compiled: the query towers and the cross-modal transformer (the key network runs without gradient).
        towers = model.unimodal
        return EngineNeeds(
            momentum_copies=(model.key,),
            sequence_parallel=tuple(transformers),
            batch_norm_across_ranks=True,
            compilable=(towers.frame_encoder, towers.temporal.encoder, towers.text, *transformers[2:]),
        )

    # --- export ---

    tower_names = ("video", "text")
    intended_use = (
        "Embedding short videos and sentences into one space: text-video retrieval and zero-shot video "
        "classification, in the languages and the domain of its training captions "
    )

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        victor, video = cast(VictorModel, model), self.settings(cfg).video
        if video.feature_dim is not None:
            video_input = TensorSpec(
                "video", "float32", (BATCH, video.num_frames, video.feature_dim), "precomputed per-frame features"
            )
        else:
            size = video.image_size
            video_input = TensorSpec(
                "video",
                "uint8",
                (BATCH, video.num_frames, 3, size, size),
                "RGB frames as raw pixels (0-255): the model normalises them with `video.mean` / `video.std`",
            )
        text = victor.unimodal.text.config
        towers = [
            Tower("video", VideoTower(victor, lambda m, v: m.encode_video(v)), (video_input,), features("video")),
            Tower(
                "text",
                TextTower(victor, lambda m, ids, mask: m.encode_text(ids, mask)),
                text_inputs(text.vocab_size, SEQUENCE),
                features("text"),
                max_sequence=text.max_position_embeddings,
            ),
        ]
        return with_output_dims(towers)

    def input_contract(self, cfg: Config, run_dir: Path, out: Path) -> dict[str, Any]:
        video = self.settings(cfg).video
        return {
            "video": {
                "frames": video.num_frames,
                "size": video.image_size,
                "mean": list(video.mean),
                "std": list(video.std),
                "sampling": "the video cut into `frames` equal segments, the middle frame of each (segment i "
                "covers frames [i*N//T, (i+1)*N//T))",
                "steps": [
                    "each frame: the shorter side resized to `size` (bilinear, antialiased), then the central "
                    "size x size crop",
                    "stacked as uint8 [frames, 3, size, size] (RGB); no normalisation: the tower applies mean/std",
                ]
                if video.backbone
                else ["precomputed per-frame features [frames, feature_dim] sampled with the same rule"],
            }
        }

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        victor = self.settings(cfg)
        video, text = victor.video, victor.text
        frames = (
            f"timm `{video.backbone}` frame encoder at {video.image_size} px"
            if video.backbone
            else (f"precomputed {video.feature_dim}-d frame features")
        )
        return (
            f"VICTOR: {frames} over {video.num_frames} frames, a temporal transformer of "
            f"{count(video.layers, 'layer')} x {video.width}, a BERT text tower of {count(text.layers, 'layer')} x "
            f"{text.width} ({text.context_length} tokens), a cross-modal transformer of "
            f"{count(victor.cross_layers, 'layer')} for the training tasks; "
            f"{victor.embed_dim}-d retrieval features, L2-normalised. The weights also hold the momentum key network, "
            "which inference does not use"
        )

    def build_loss(self, cfg: Config) -> VictorLoss:
        tokenizer = TextTokenizer(self.settings(cfg).tokenizer, self.settings(cfg).text.context_length)
        return VictorLoss(
            self.settings(cfg), tokenizer.token_id("[MASK]"), self.settings(cfg).text.vocab_size or tokenizer.vocab_size
        )

    def train_data(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int) -> BatchStream:
        return BatchStream(
            stream_spec(cfg, rank=rank, world_size=world_size), self.video_decoder(cfg, run_dir, train=True)
        )

    def training_step(
        self, model: VictorModel, loss: VictorLoss, batch: dict[str, Any], pool: Any = None, index: int = 0
    ) -> dict[str, torch.Tensor]:
        video = batch["frames"] if "frames" in batch else batch["frame_features"]
        ids, mask = batch["input_ids"], batch["attention_mask"]
        w, towers = loss.weights, model.unimodal
        frames = towers.frame_encoder(video)  # [B, T, Wv], shared by every task
        batch_size, steps = frames.shape[:2]
        terms: dict[str, torch.Tensor] = {}
        key_frames, key_video, key_text = model.key(video, ids, mask) if (w.dual_vsa or w.inter_mfm) else (None,) * 3
        # The model has the cross-modal transformer and the heads the enabled tasks use (VictorModel builds them).
        cross, mlm_head, sentence_order_head = model.cross, model.mlm_head, model.sentence_order_head
        frame_head, frame_order_head = model.frame_head, model.frame_order_head

        clean_text = None
        if w.dual_vsa:
            assert key_video is not None and key_text is not None
            clean_text = towers.text_hidden(ids, mask)
            video_query = towers.pooled_video(towers.temporal(frames))
            text_query = towers.pooled_text(clean_text)
            terms["dual_vsa"] = w.dual_vsa * dual_vsa_loss(
                video_query,
                text_query,
                key_video,
                key_text,
                loss.text_queue.contents(),
                loss.video_queue.contents(),
                model.vsa_scale(),
            )

        if w.mlm or w.msom or w.intra_mfm or w.inter_mfm:
            assert cross is not None
            text_ids, labels = ids, None
            order = None
            if w.mlm:
                text_ids, labels = mask_tokens(ids, mask, loss.mask_id, loss.vocab_size, loss.mlm_probability)
            if w.msom:
                order = random_permutations(batch_size, ids.device)
                text_ids, *rest = permute_sentences(text_ids, mask, order, *([labels] if labels is not None else []))
                labels = rest[0] if rest else None
            frame_mask = (
                mask_frames(batch_size, steps, loss.frame_mask_ratio, frames.device)
                if (w.intra_mfm or w.inter_mfm)
                else None
            )
            text_out, frame_out = cross(
                towers.text_hidden(text_ids, mask), mask, towers.temporal(frames, frame_mask)[:, 1:]
            )
            if w.mlm:
                assert mlm_head is not None and labels is not None
                # every position through the head, the unchosen ones ignored: no selection sized on the device
                terms["mlm"] = w.mlm * masked_lm_loss(mlm_head(text_out), labels, ignore_index=IGNORE)
            if w.msom:
                assert sentence_order_head is not None and order is not None
                terms["msom"] = w.msom * order_loss(sentence_order_head(text_out[:, 0]), order)
            if frame_mask is not None:
                assert frame_head is not None
                predicted = frame_head(frame_out)
                if w.intra_mfm:
                    terms["intra_mfm"] = w.intra_mfm * intra_mfm_loss(
                        predicted, frames, frame_mask, loss.mfm_temperature
                    )
                if w.inter_mfm:
                    assert key_frames is not None
                    terms["inter_mfm"] = w.inter_mfm * inter_mfm_loss(
                        predicted, key_frames, frame_mask, loss.frame_queue.contents(), loss.mfm_temperature
                    )

        if w.mfom:
            assert cross is not None and frame_order_head is not None
            order = random_permutations(batch_size, ids.device)
            text_hidden = clean_text if clean_text is not None else towers.text_hidden(ids, mask)
            text_out, _ = cross(text_hidden, mask, towers.temporal(permute_frames(frames, order))[:, 1:])
            terms["mfom"] = w.mfom * order_loss(frame_order_head(text_out[:, 0]), order)

        if w.dual_vsa:
            assert key_video is not None and key_text is not None
            loss.video_queue.push(key_video)
            loss.text_queue.push(key_text)
        if w.inter_mfm:
            assert key_frames is not None
            loss.frame_queue.push(key_frames.flatten(0, 1))
        return terms

    def zeroshot(
        self,
        model: VictorModel,
        cfg: Config,
        run_dir: Path,
        dataset: str,
        language: str,
        task: str = "zeroshot_retrieval",
        foreign_class_names: bool = False,
    ) -> dict[str, Any]:
        """Text-to-video and video-to-text retrieval on an annotation file (or the demo's held-out split),
        or zero-shot classification over a folder of class-named clips (`foreign_class_names`: accept class
        names not written in `language`)."""
        ev = self.settings(cfg).retrieval
        if task == "zeroshot_classification":
            from mmpt.eval.video_classification import load_video_classification_set, video_classification

            data = load_video_classification_set(dataset, language, foreign_class_names)
            metrics = video_classification(
                model,
                self.tokenizer(cfg, run_dir),
                self.video_decoder(cfg, run_dir, train=False).decode_video,
                data,
                batch_size=ev.batch_size,
                device=next(model.parameters()).device,
            )
            return eval_record(run_dir, dataset, task, language, metrics, templates=data.templates_from)
        if task != "zeroshot_retrieval":
            raise ValueError(f"the victor method evaluates zeroshot_retrieval or zeroshot_classification, not {task!r}")
        from mmpt.eval.video_retrieval import video_retrieval

        path = Path(dataset)
        if dataset == "moving_digits":
            path = Path(cfg.data.root) / "moving_digits" / "test" / f"retrieval_{language}.jsonl"
        metrics = video_retrieval(
            model,
            self.tokenizer(cfg, run_dir),
            self.video_decoder(cfg, run_dir, train=False).decode_video,
            path,
            batch_size=ev.batch_size,
            device=next(model.parameters()).device,
            video_root=ev.video_root,
        )
        return eval_record(run_dir, dataset, task, language, metrics)


METHOD = register(VictorMethod())

"""Typed run configuration: YAML files that may extend a base, dotted CLI overrides, validation.

Every knob of a run lives here. Validation happens before any process group starts, and an error
names the key, the file it came from and the closest valid key, in one line.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mmpt.errors import ConfigError as ConfigError  # re-exported: the schema's error

COMMAND_LINE = "<command line>"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FieldKeys(Section):
    """Where samples of a shard set keep their fields (`mmpt.data.fields`), and how their text is encoded."""

    caption_key: str | list[str] | None = Field(
        default=None,
        description="where a sample's caption is: a tar member's extension (txt) or a field of its json member "
        "(json.caption_zh); a list, or a field holding a list, gives several captions, one drawn per read "
        "(seeded, resumable). None: the method's default members",
    )
    image_key: str | list[str] | None = Field(
        default=None,
        description="tar member(s) holding the image, first present wins (e.g. jpg, webp). None: jpg, jpeg, png, webp",
    )
    text_encoding: str = Field(
        default="utf-8",
        description="encoding of the source's text members (e.g. gbk for legacy corpora); samples not "
        "valid in it are skipped and counted as skipped/text_encoding",
    )

    @field_validator("*")
    @classmethod
    def _check_field(cls, value: Any, info: ValidationInfo) -> Any:
        from mmpt.data.fields import SampleFields

        name = info.field_name or ""
        if value is not None and (name.endswith("_key") or name == "text_encoding"):
            SampleFields.of(**{name.removesuffix("_key"): value})  # raises ValueError saying what is wrong
        return value

    def sample_fields(self):
        """These keys as `mmpt.data.fields.SampleFields`."""
        from mmpt.data.fields import SampleFields

        return SampleFields.of(self.caption_key, self.image_key, getattr(self, "video_key", None), self.text_encoding)

    def fields_set(self) -> list[str]:
        """The field keys (caption, image, video) this set names."""
        return [name for name in ("caption", "image", "video") if getattr(self, f"{name}_key", None) is not None]


class SourceConfig(FieldKeys):
    """One WebDataset source: a brace pattern of shards, its mixing weight, where its samples keep their fields."""

    shards: str = Field(description="brace pattern or comma list of tar shards, e.g. dir/train-{000000..000009}.tar")
    weight: float = Field(default=1.0, gt=0, description="relative sampling weight when several sources are mixed")
    name: str | None = Field(
        default=None, description="how the source is called in per-source batches and logs (default: shards)"
    )
    video_key: str | list[str] | None = Field(
        default=None, description="tar member(s) holding the video, first present wins. None: mp4, webm, avi"
    )


class LoaderConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1)
    mode: Literal["resampled", "epoch"] = Field(
        default="resampled",
        description="resampled: shards drawn with replacement forever; epoch: each sample once per epoch",
    )
    batch_size: int = Field(gt=0, description="micro-batch size per rank")
    compose: Literal["mixed", "per_source"] = Field(
        default="mixed",
        description="mixed: sources interleaved at random by weight into one batch; per_source: every batch "
        "takes a fixed share of batch_size from each source (by weight) and hands one sub-batch per source, by name",
    )
    num_workers: int = Field(default=1, ge=0)
    shuffle_buffer: int = Field(default=1000, ge=0, description="sample shuffle buffer per worker (0 = no shuffle)")
    max_skip_rate: float = Field(
        default=0.01, ge=0, le=1, description="fail once more than this fraction of samples fail"
    )
    min_samples_for_skip_rate: int = Field(
        default=200,
        ge=1,
        description="samples read before the skip-rate limit applies (avoids failing on the first bad sample)",
    )

    @model_validator(mode="after")
    def _check_per_source(self) -> LoaderConfig:
        if self.compose == "per_source":
            from mmpt.data.loader import batch_shares

            names = [s.name or s.shards for s in self.sources]
            if len(set(names)) != len(names):
                raise ValueError(f"per_source batches need distinct source names, got {names}")
            batch_shares(self.batch_size, [s.weight for s in self.sources])
        return self


EvalTask = Literal["zeroshot_classification", "zeroshot_retrieval", "intent"]


class EvalSetConfig(FieldKeys):
    """One evaluation set, run every `train.eval_every` steps and at the end of training. Its field keys say where
    samples keep their image and captions when the set is read from shards (a retrieval set of tar shards,
    such as held-out img2dataset output, reads every caption its keys hold)."""

    dataset: str = Field(
        description="a folder or file in any layout launch/zeroshot.py (or, for intent, "
        "launch/intent_eval.py) reads, tar shards for retrieval (dir/{00000..00003}.tar), or a demo "
        "set name (digits, moving_digits, dialogs)"
    )
    task: EvalTask = Field(
        description="zeroshot_classification (images or clips), zeroshot_retrieval (image-text or video-text), "
        "intent (dialog intent probe); the method must offer it"
    )
    name: str | None = Field(
        default=None,
        description="reported as eval/<name>/<language>/<metric> (default: the dataset's folder or file name)",
    )
    languages: list[str] = Field(
        default_factory=lambda: ["en"],
        min_length=1,
        description="languages to evaluate in (class names and prompts, or captions, in each); a set in one "
        "language only (a dialog intent set, most retrieval sets) takes one entry, the label of its results",
    )
    foreign_class_names: bool = Field(
        default=False, description="accept class names not written in the prompt language"
    )

    @property
    def label(self) -> str:
        return self.name or Path(self.dataset.rstrip("/")).stem


class DataConfig(Section):
    train: LoaderConfig
    eval: list[EvalSetConfig] = Field(
        default_factory=list,
        description="what a run evaluates: these sets, at the end of training and every train.eval_every steps",
    )
    prepare: str | None = Field(
        default=None, description="name of a demo corpus (mmpt.demo) to build under `root` on first use, e.g. digits"
    )
    root: str = Field(default="demo_data", description="directory the demo corpus is built in")

    @field_validator("eval")
    @classmethod
    def _distinct_eval_names(cls, sets: list[EvalSetConfig]) -> list[EvalSetConfig]:
        labels = [s.label for s in sets]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation sets need distinct names (set 'name' on all but one), got {labels}")
        return sets

    @field_validator("prepare")
    @classmethod
    def _known_corpus(cls, name: str | None) -> str | None:
        if name is not None:
            from mmpt import demo

            if name not in demo.corpora():
                close = difflib.get_close_matches(name, demo.corpora(), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ValueError(f"not a demo corpus ({hint}known: {', '.join(demo.corpora())})")
        return name


class OptimConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="floor of the decay as a fraction of lr")
    decay: Literal["cosine", "linear"] = Field(default="cosine", description="shape of the decay after warmup")
    no_decay: list[str] = Field(
        default_factory=lambda: ["bias", "norm", "logit_scale", "pos_embed", "position_embeddings", "cls_token"],
        description="parameters whose name contains one of these (or that are 1-D) get no weight decay",
    )
    lr_scales: dict[str, float] = Field(
        default_factory=dict,
        description="learning-rate multipliers by parameter name pattern (fnmatch on the names model.safetensors "
        "has, e.g. 'clip.visual.*': 0.1), applied through warmup and decay; the first matching pattern counts, "
        "unmatched parameters keep lr",
    )

    layer_decay: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="layer-wise rate decay (as EVA-CLIP fine-tunes): a tower's group k blocks before its last trains "
        "at lr x layer_decay^k (its last group, the head, at lr); parameters outside the towers keep lr; "
        "multiplies lr_scales. Image-text methods",
    )

    @field_validator("lr_scales")
    @classmethod
    def _positive_scales(cls, scales: dict[str, float]) -> dict[str, float]:
        for pattern, scale in scales.items():
            if scale <= 0:
                raise ValueError(f"the scale of {pattern!r} is {scale}; lock a tower to stop training it")
        return scales


class TrainConfig(Section):
    max_steps: int = Field(gt=0, description="optimizer steps")
    grad_accum: int = Field(default=1, gt=0, description="micro-batches per optimizer step")
    grad_clip: float = Field(
        ge=0, description="global grad-norm clip; 0 disables. Always explicit: no DeepSpeed default"
    )
    pool_pass: Literal["auto", "separate", "merged"] = Field(
        default="auto",
        description="how a step pools its micro-batches for the loss (pooled accumulation, grad_accum > 1). "
        "separate: a forward without gradient of every micro-batch builds the pool, then each runs forward and "
        "backward; merged: every micro-batch's forward with gradient, the loss once over all, one backward (one "
        "forward less; holds all K micro-batches' activations). auto: merged where the towers checkpoint their "
        "activations",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="fp16, and bf16 at ZeRO 1-3: DeepSpeed's 16-bit model with fp32 master weights; bf16 at ZeRO-0: "
        "an fp32 model under autocast (docs/engine.md); fp16 needs a GPU",
    )
    zero_stage: int = Field(default=0, ge=0, le=3)
    peak_tflops: float | None = Field(
        default=None,
        gt=0,
        description="dense TFLOP/s per GPU that perf/mfu is stated against (docs/engine.md). None: the bf16 "
        "peak of an H100, H200 or A100 in a bf16 run, else no perf/tflops nor perf/mfu (nothing is claimed on CPU)",
    )
    offload_optimizer: bool = False
    reduce_bucket_size: int | None = Field(
        default=None,
        gt=0,
        description="gradient elements per DeepSpeed reduction bucket (ZeRO 1-3), e.g. 50000000; "
        "None: on GPUs at ZeRO 1-2 a quarter of the model's parameters within 50000000-200000000; elsewhere "
        "DeepSpeed's 500000000",
    )
    overlap_comm: bool | None = Field(
        default=None,
        description="ZeRO 1-3: reduce gradient buckets on a side stream while backward runs (GPUs; CPU "
        "ranks have no streams, it only costs there). None: at ZeRO 1-2 on GPUs, on when the model spans more "
        "than one bucket; elsewhere DeepSpeed's choice (off at ZeRO 1-2, on at ZeRO-3)",
    )
    hpz_partition_size: int | Literal["node"] | None = Field(
        default=None,
        description="ZeRO-3 only: ZeRO++ hierarchical partitioning. Each rank also keeps the parameters "
        "sharded over a group of this many consecutive ranks, so backward's all-gathers stay inside the group; "
        "'node': the ranks of one node. Costs that secondary shard per rank; pays off only across nodes",
    )
    sequence_parallel: int = Field(
        default=1,
        ge=1,
        description="Ulysses sequence parallelism: this many consecutive ranks read the same samples and "
        "split the sequence of the transformers the method declares (all-to-all around attention); must divide the "
        "ranks. 1: off",
    )
    tf32: bool = Field(
        default=True,
        description="fp32 matrix products and convolutions on NVIDIA GPUs use TF32 tensor cores (10 mantissa bits, "
        "several times plain fp32's speed); the losses' logits stay full fp32. No effect on CPU",
    )
    compile: bool | Literal["auto"] = Field(
        default=False,
        description="compile the towers the method declares with torch.compile (inductor), in place: weights, "
        "checkpoints and exports keep their names. Not with sequence parallelism. auto: on for GPU runs "
        "where it is supported (ZeRO 0-2, no sequence parallelism, a method with towers to compile), off elsewhere",
    )
    adaptive_batch: bool = Field(
        default=False,
        description="each data-parallel rank's micro-batch follows its measured speed (busy time outside "
        "collectives), re-decided at logging windows and the same on every rank; the global batch stays "
        "data.train.batch_size x ranks, and each rank's loss is weighed by its share so the gradient is that of "
        "equal shares. Not with sequence parallelism",
    )
    adaptive_batch_units: int = Field(
        default=4,
        gt=0,
        description="adaptive batches move samples between ranks in units of data.train.batch_size / this "
        "(it must divide the batch size): larger, finer shares; smaller, fewer and larger loader deliveries",
    )
    adaptive_batch_max_share: float = Field(
        default=2.0,
        gt=1,
        description="the largest micro-batch a rank may get under adaptive batches, as a multiple of "
        "data.train.batch_size: what its accelerator memory must hold",
    )
    log_every: int = Field(default=10, gt=0)
    eval_every: int = Field(
        default=0,
        ge=0,
        description="evaluate the data.eval sets every n steps as well as at the end (0: only at the end); needs "
        "a data.eval set and n at most train.max_steps. Evaluation leaves training exactly as it would be without it",
    )
    save_every: int = Field(default=0, ge=0, description="checkpoint every n steps (0: only at the end)")
    keep_last: int = Field(default=2, gt=0, description="checkpoints kept on disk")
    seed: int = 0
    max_bad_steps: int = Field(
        default=10,
        gt=0,
        description="stop after this many optimizer steps in a row skipped for a non-finite loss or gradient",
    )
    watchdog_timeout: float = Field(
        default=1800.0,
        ge=0,
        description="seconds without progress (a step, a checkpoint) before the run exits; 0 = off",
    )
    rank_health: bool = Field(
        default=False,
        description="time every collective and name a rank that arrives late or whose collectives are slow "
        "(docs/fault_tolerance.md); train.adaptive_batch turns it on too. Off: nothing wraps torch.distributed "
        "or DeepSpeed's collectives",
    )
    straggler_factor: float = Field(
        default=1.5,
        gt=1,
        description="a rank whose busy time (outside collectives) is this many times its peers' median arrives late",
    )
    straggler_windows: int = Field(
        default=3, gt=0, description="logging windows in a row a rank must be unhealthy (late or slow) to be named"
    )
    slow_collective_factor: float = Field(
        default=2.0,
        gt=1,
        description="a rank whose collectives return this many times later than its peers' (after the last rank "
        "arrived) has slow collectives: its link or node",
    )
    unhealthy_min_share: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="a late arrival or slow collectives count only when they cost this share of the logging window",
    )
    on_unhealthy: Literal["warn", "stop"] = Field(
        default="warn",
        description="when a rank is named late or slow: warn (log and <output_dir>/unhealthy.json), or stop "
        "(exit 76, so the scheduler restarts without its node)",
    )

    @field_validator("hpz_partition_size", mode="before")
    @classmethod
    def _hpz_size(cls, value: Any) -> Any:
        if value is None or value == "node" or (type(value) is int and value >= 2):
            return value
        raise ValueError("expected a number of ranks >= 2, or 'node'")


class WandbConfig(Section):
    """Weights & Biases logging (the optional `wandb` package: pip install 'mmpt[wandb]')."""

    project: str = Field(description="W&B project")
    name: str | None = Field(default=None, description="run name (default: the output folder's name)")
    entity: str | None = Field(default=None, description="team or user (default: W&B's default entity)")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online", description="offline: written under output_dir/wandb, for `wandb sync` later (no network)"
    )
    tags: list[str] = Field(default_factory=list)


class RunConfig(Section):
    output_dir: str
    resume: str = Field(
        default="auto", description="auto: newest checkpoint in output_dir if any; none; or a checkpoint path"
    )
    tensorboard: bool = True
    progress_bar: bool = True
    wandb: WandbConfig | None = Field(
        default=None,
        description="log the same scalars as TensorBoard, and the resolved "
        "config, to Weights & Biases; a resumed run continues its W&B run",
    )


class Config(Section):
    """A whole run. `method` is validated against the schema its method registers."""

    method: SerializeAsAny[BaseModel]
    run: RunConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig

    @property
    def method_name(self) -> str:
        return self.method.name  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _merge(base: dict, top: dict, origins: dict[str, str], source: str | None, prefix: str = "") -> dict:
    """Deep-merge `top` into `base`, recording for each key path the file that set it last.

    `source=None` merges a base file's result, whose origins were recorded when it was read.
    """
    out = dict(base)
    for key, value in top.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, origins, source, path + ".")
        else:
            out[key] = value
            if source is not None:
                _record_origins(value, path, origins, source)
    return out


def _record_origins(value: Any, path: str, origins: dict[str, str], source: str) -> None:
    for stale in [k for k in origins if k == path or k.startswith(path + ".")]:
        del origins[stale]
    origins[path] = source
    if isinstance(value, dict):
        for key, sub in value.items():
            _record_origins(sub, f"{path}.{key}", origins, source)
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            _record_origins(sub, f"{path}.{index}", origins, source)


def _load_with_bases(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict, dict[str, str]]:
    """(merged data, key path -> file that set it) of one file and the bases it extends."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'extends' forms a cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    raw = _read_yaml(path)
    bases = raw.pop("extends", [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: 'extends' must be a file path or a list of paths")
    merged: dict = {}
    origins: dict[str, str] = {}
    for base in bases:
        local = path.parent / base
        try:  # a path beside this file, else a shipped config's name (`clip/demo`), as --config takes it
            found = local if local.is_file() else shipped_config(base)
        except ConfigError as exc:
            raise ConfigError(f"{path}: 'extends': {exc}") from None
        data, base_origins = _load_with_bases(found, (*seen, path))
        merged = _merge(merged, data, origins, None)
        origins.update(base_origins)  # a later base wins for the keys it sets
    return _merge(merged, raw, origins, str(path)), origins


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"{COMMAND_LINE}: override {text!r} must look like key.path=value")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"{COMMAND_LINE}: override {text!r} has an empty key")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        if value.lstrip()[:1] in ("[", "{") and (": " in value or ", " in value):  # YAML cut short, not a pattern
            problem = getattr(exc, "problem", None) or "not valid YAML"
            raise ConfigError(
                f"{COMMAND_LINE}: override {key}={value!r} is not a whole YAML value: {problem}"
            ) from None
        parsed = value  # a string YAML would misread: a shard pattern starting with '*' or '{'
    return key.split("."), parsed


def _apply_override(data: dict, parts: list[str], value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        nxt = _child(node, part)
        if nxt is None:
            nxt = {}
            _set_child(node, part, nxt, parts[: depth + 1])
        node = nxt
    _set_child(node, parts[-1], value, parts)


def _child(node: Any, part: str) -> Any:
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    if isinstance(node, dict):
        return node.get(part)
    return None


def _set_child(node: Any, part: str, value: Any, parts: list[str]) -> None:
    key, parent = ".".join(parts), ".".join(parts[:-1])
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            raise ConfigError(f"{COMMAND_LINE}: '{key}': index {part!r} is out of range for a list of {len(node)}")
        node[int(part)] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise ConfigError(f"{COMMAND_LINE}: '{key}': '{parent}' is not a mapping")


def _model_at(loc: tuple, data: dict, method_section: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of `loc` (for 'did you mean')."""
    model: Any = Config
    node: Any = data
    for part in loc[:-1]:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        if isinstance(part, int):
            continue
        if model is Config and part == "method":
            model = method_section
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = _inner_model(field.annotation)
        if model is None:
            return None
    return model


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def origin(origins: dict[str, str], dotted: str, default: str) -> str:
    """The file (or the command line) that set config key `dotted`; `default` if none recorded it."""
    while dotted:
        if origins.get(dotted):
            return origins[dotted]
        dotted = dotted.rpartition(".")[0]
    return default


def _without_tags(loc: tuple, data: dict) -> tuple:
    """`loc` without the entries pydantic adds for a section of several kinds (its `name`: `method.loss.contrastive`
    for `method.loss` named contrastive), so that messages name keys as configs write them."""
    kept, node = [], data
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("name") == part:
            continue
        kept.append(part)
        node = node.get(part) if isinstance(node, dict) else None
    return tuple(kept)


def _explain(
    exc: ValidationError,
    data: dict,
    origins: dict[str, str],
    top_file: str,
    method_section: type[BaseModel],
    prefix: tuple = (),
) -> str:
    errors = exc.errors()
    # A misspelt key is also a missing one: name the misspelling, with its likely meaning.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = _without_tags(prefix + tuple(err["loc"]), data)
    dotted = ".".join(str(p) for p in loc)
    where = origin(origins, dotted, top_file)
    if err["type"] == "extra_forbidden":
        owner = _model_at(loc, data, method_section)
        hint = ""
        if owner is not None:
            parent = ".".join(str(p) for p in loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), list(owner.model_fields), n=1, cutoff=0.5)
            if close:
                hint = f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)"
            else:
                hint = f" (valid keys{' under ' + repr(parent) if parent else ''}: {', '.join(owner.model_fields)})"
        return f"{where}: unknown config key '{dotted}'{hint}"
    if err["type"] == "missing":
        if any(isinstance(part, int) for part in loc):  # in a list entry: where the list was written
            return f"{where}: required config key '{dotted}' is missing"
        return f"{top_file}: required config key '{dotted}' is missing (set it there or in a file it extends)"
    if err["type"] == "union_tag_not_found":  # a section of several kinds set key by key, without its name
        kinds = err.get("ctx", {}).get("discriminator", "'name'")
        return f"{where}: config key '{dotted}' needs its {kinds} beside the other keys (e.g. {dotted}.name=...)"
    value, message = err.get("input"), err["msg"].removeprefix("Value error, ")
    if isinstance(value, (dict, list)):
        return f"{where}: config key '{dotted}': {message}"
    return f"{where}: config key '{dotted}' = {value!r}: {message}"


def shipped_configs() -> Path:
    """The configs mmpt ships: `configs/` of a source checkout, or the copy an installed wheel carries."""
    checkout = Path(__file__).resolve().parents[1] / "configs"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "configs"


def shipped_config(path: str | os.PathLike) -> Path:
    """`path` where that file exists, else the shipped config it names (`m2_encoder/0.4b`, with or without
    `.yaml` or a leading `configs/`); a name that is neither is one line listing the shipped ones."""
    if Path(path).is_file():
        return Path(path)
    root = shipped_configs()
    name = str(path).removeprefix("configs/")
    for candidate in (root / name, root / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(str(f.relative_to(root).with_suffix("")) for f in root.glob("*/*.yaml") if f.parent.name != "base")
    raise ConfigError(f"config file not found: {path} (nor a shipped config: {', '.join(names)})")


def read_config(
    path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[dict, dict[str, str], str]:
    """(merged data, key path -> file that set it, top file) of `path`, its bases and `key.path=value` overrides.
    `path` may also name a shipped config (`shipped_config`)."""
    path = shipped_config(path)
    top_file = str(Path(path).resolve())
    data, origins = _load_with_bases(Path(path))
    for text in overrides:
        parts, value = _parse_override(text)
        _apply_override(data, parts, value)
        _record_origins(value, ".".join(parts), origins, COMMAND_LINE)
    return data, origins, top_file


def validate_sections(data: dict, origins: dict[str, str], top_file: str, method_section: type[BaseModel]) -> Config:
    """`data` as a Config, its `method:` section validated by `method_section` (the method's own schema)."""
    try:
        method = method_section.model_validate(data["method"])
    except ValidationError as exc:
        raise ConfigError(_explain(exc, data, origins, top_file, method_section, ("method",))) from None
    try:
        return Config.model_validate({**data, "method": method})
    except ValidationError as exc:
        raise ConfigError(_explain(exc, data, origins, top_file, method_section)) from None


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True))

"""What a method supplies to the engine. Nothing here knows about ranks, precision or checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast, runtime_checkable

import torch
from torch import nn

from mmpt.config import Section
from mmpt.models.momentum import MomentumCopy
from mmpt.models.tensor_files import TensorReader

if TYPE_CHECKING:
    from mmpt.config import Config, EvalSetConfig
    from mmpt.data.loader import BatchStream, StreamSpec
    from mmpt.methods.towers import Tower


class MethodConfig(Section):
    """The `method:` section of a config; each method extends it with its own keys."""

    name: str


@dataclass(frozen=True)
class AfterStep:
    """Work to run after every applied optimizer step (e.g. an EMA update), and the parameters it reads:
    the engine makes those whole on this rank while it runs, whatever the ZeRO stage."""

    run: Callable[[], None]
    reads: Callable[[], Iterable[nn.Parameter]] = tuple


DIAGNOSTICS = "train"  # the key of `training_step`'s diagnostics


def loss_terms(terms: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The terms of `training_step` that make up the loss."""
    return {name: value for name, value in terms.items() if name != DIAGNOSTICS}


def diagnostics(terms: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`training_step`'s diagnostics, named as they are logged ("train/<name>")."""
    return {f"{DIAGNOSTICS}/{name}": value for name, value in terms.get(DIAGNOSTICS, {}).items()}


@dataclass(frozen=True)
class EngineNeeds:
    """Everything a method asks of the engine besides running `training_step` (see `Method.engine_needs`); each
    field's contract is in docs/adding_a_method.md ("What a method may ask of the engine")."""

    pool_features: Callable[[Any, Any], Any] | None = None  # (model, one micro-batch) -> what the pool keeps
    step_pool: Callable[[Any, list[Any]], Any] | None = None  # (loss, each micro-batch's pool features) -> pool
    merged_step: Callable[[Any, Any, list[Any]], dict[str, Any]] | None = None  # (model, loss, micro-batches) -> terms
    fp32_modules: tuple[nn.Module, ...] = ()
    after_step: tuple[AfterStep, ...] = ()
    momentum_copies: tuple[MomentumCopy, ...] = ()
    sequence_parallel: tuple[nn.Module, ...] = ()
    batch_norm_across_ranks: bool = False
    compilable: tuple[nn.Module, ...] = ()
    tower_groups: dict[str, list[list[nn.Parameter]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.pool_features is None) != (self.step_pool is None):
            raise TypeError("EngineNeeds: pooled accumulation needs both pool_features and step_pool")
        if self.merged_step is not None and self.step_pool is None:
            raise TypeError("EngineNeeds: merged_step runs pooled accumulation: pool_features and step_pool too")

    def pool(self, model: Any, loss: Any, micro_batches: list[Any]) -> Any:
        """The step's pool from its micro-batches (without the engine's replay of random draws)."""
        assert self.pool_features is not None and self.step_pool is not None
        return self.step_pool(loss, [self.pool_features(model, batch) for batch in micro_batches])


@dataclass(frozen=True)
class OpenClipFolder:
    """What `Method.open_clip_export` gives for `launch/export.py --format open_clip`: open_clip's model config
    and state dict of the model, and what the folder's card says besides the format's own lines: `notes`
    (paragraphs of "How to use it") and `files` ((name, what it is) of files the hook wrote there)."""

    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    notes: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class OfficialFolder:
    """What `Method.official_export` wrote for `launch/export.py --format official`: the model card's title
    (after the folder's name), its "How to use it" section (Markdown lines, below the heading) and the files
    ((name, what it is), the checkpoint first)."""

    title: str
    usage: tuple[str, ...]
    files: tuple[tuple[str, str], ...]


SectionT = TypeVar("SectionT")  # a method's own `method:` section (its `config_class`)


class Method(Generic[SectionT]):
    """Interface of a training method. Subclass it as ``Method[MyConfig]``, set ``name`` and ``config_class``."""

    name: str
    config_class: type[MethodConfig] = MethodConfig
    sample_fields: tuple[str, ...] = ()  # which of a source's caption_key, image_key, video_key the data reads
    eval_tasks: tuple[str, ...] = ()  # the `data.eval` tasks `evaluate_set` runs
    eval_sample_fields: tuple[str, ...] = ()  # which field keys of a `data.eval` set `evaluate_set` reads
    # Dotted overrides that shrink any of this method's configs to a test-sized model on the demo corpora,
    # with no edit of the file (the tests train every config and every method with them). Placeholders:
    # {digits}, {video}, {dialogs} (demo corpora folders), {bert} (a small BERT-family checkpoint), {repo}.
    tiny_overrides: tuple[str, ...] = ()
    # Where the image or video tower's `TowerSwitches` (gradient checkpointing, patch dropout) sit in the
    # config, e.g. "method.image"; None for a method without such a tower.
    tower_switches: str | None = None
    # Export (`mmpt.export`, `launch/export.py`). The towers `export_towers` returns, by name and in order
    # ("image", "text", "video", "dialog"): ONNX export and the model card read them without building a model;
    # a method without any has no ONNX export.
    tower_names: tuple[str, ...] = ()
    # The export formats besides "release" and "onnx" its models go to ("open_clip": `open_clip_export`;
    # "official": `official_export`, the checkpoint layout of the method's official code); `export_problem`
    # may refuse a config.
    transformers_code = False  # its "transformers" folder carries its own modelling code (trust_remote_code)
    export_formats: tuple[str, ...] = ()
    # With "official": what `--format official` writes, as a release's card says it ("the checkpoint ... reads").
    official_layout: str = ""
    # The model card's "Intended use", up to where the card goes on "(see Training data). It is known to do
    # only what the evaluation above measured ...": what the model's features are for, in what languages.
    intended_use: str = (
        "Features of the inputs its towers take, for retrieval and classification, in the languages and the "
        "domain of its training data "
    )

    def settings(self, cfg: Config) -> SectionT:
        """This method's `method:` section of `cfg`, with its own schema's type (the shared schema types the
        section only as a model: it cannot know the methods built on it)."""
        return cast(SectionT, cfg.method)

    def prepare(self, cfg: Config, run_dir: Path) -> None:
        """Put what the model needs besides weights (e.g. tokenizer files) into `run_dir`. Rank 0 only."""

    def release_files(self, cfg: Config) -> list[str]:
        """Names in the run directory (files or folders) that `build_model` reads; a release carries them."""
        return []

    def preprocessors(self, cfg: Config, run_dir: Path) -> dict[str, Any]:
        """What turns raw inputs into model inputs for a released model: "tokenizer", "preprocess"
        (evaluation transform) and "preprocess_train", where they apply."""
        return {}

    def build_model(self, cfg: Config, run_dir: Path) -> nn.Module:
        """The model that is trained and saved; parameters only, no loss state."""
        raise NotImplementedError

    def use_carried_files(self, cfg: Config, folder: Path) -> None:
        """Point `cfg`, read from a run or release `folder`, at the files the folder carries (`release_files`) where
        the config names them by the paths it was trained with, which may be gone or relative to another
        working directory."""

    def resolve_defaults(self, cfg: Config) -> None:
        """Fill in config values whose defaults are found on disk (e.g. the tokenizer that comes with initial
        weights). Runs on every rank before training, so the run's saved config names them."""

    def input_paths(self, cfg: Config) -> dict[str, str | None]:
        """{config key: the file or folder it names} of every input the method reads (tokenizer, initial weights,
        evaluation sets), checked to exist before training starts. Leave out names that are not paths (a demo
        set's name, a package resource)."""
        return {}

    def check_eval_sets(self, cfg: Config) -> None:
        """`check_eval_set` on each `data.eval` set (but the demos', built later), raising ValueError naming its
        config key where one cannot be read: found before training, not after it."""
        from mmpt.data.shards import DataError
        from mmpt.eval import DEMO_NAMES

        for index, eval_set in enumerate(cfg.data.eval):
            if eval_set.dataset in DEMO_NAMES or not Path(eval_set.dataset).exists():
                continue  # a demo set, or tar shards (read whole when evaluated)
            try:
                self.check_eval_set(cfg, eval_set)
            except (DataError, ValueError) as exc:
                raise ValueError(f"config key 'data.eval.{index}.dataset': {exc}") from None

    def check_eval_set(self, cfg: Config, eval_set: EvalSetConfig) -> None:
        """Read what `eval_set` needs before it can be evaluated (class names, a listing's files; nothing decoded);
        raise DataError or ValueError where it cannot be."""

    def check_initial_weights(self, cfg: Config) -> None:
        """Find the initial weights (and the tokenizer file) and raise ConfigError naming the key where they cannot
        be read or do not fit the model (before any process group starts)."""

    def load_initial_weights(self, model: nn.Module, cfg: Config) -> str | None:
        """Start training from existing weights (e.g. an official checkpoint); not used when loading a run.
        Returns one line saying what was loaded from where (logged at the start of training), or None."""

    def initial_tensors(self, cfg: Config) -> Callable[[nn.Module], tuple[str, TensorReader]] | None:
        """Where this config's initial weights give every tensor the model saves (a strict load): a function
        that opens them for a model, returning (the line `load_initial_weights` would return, a reader of
        whole tensors one at a time). With it the engine fills a model built partitioned (ZeRO-3) without
        any process building the model whole. None (the default): the engine builds the model whole on
        rank 0 and calls `load_initial_weights`. Deciding reads no file (the planner asks too)."""
        return None

    def summary_lines(self, cfg: Config) -> list[str]:
        """Lines of the run summary on what this method's section changes about training (its loss, a teacher,
        locked towers): what the engine's own lines cannot know."""
        return []

    def build_loss(self, cfg: Config) -> nn.Module:
        raise NotImplementedError

    def teacher(self, cfg: Config) -> Any:
        """A frozen model the loss reads beside the model (a `mmpt.methods.teacher.Teacher`; None: none). The engine
        builds it as it builds the model, partitioned under ZeRO-3, and hands it to `Teacher.around(loss, teacher)`."""
        return None

    def export_towers(self, model: nn.Module, cfg: Config) -> list[Tower]:
        """The towers named in `tower_names`, in that order, wrapping `model` (built by `build_model`, in eval
        mode): modules whose inputs are plain tensors (`mmpt.methods.towers`), what an ONNX export runs."""
        raise NotImplementedError(f"the '{self.name}' method declares no towers for export")

    def input_contract(self, cfg: Config, run_dir: Path, out: Path) -> dict[str, Any]:
        """Entries of an ONNX export's `preprocessing.json` that say how raw inputs become the inputs of towers
        other than "image" and "text" (whose preprocessing and tokenizer the export reads from
        `preprocessors`), e.g. {"video": {...}}; may copy the files they name into `out`."""
        return {}

    def architecture(self, cfg: Config, run_dir: Path) -> str:
        """One paragraph of the model card describing the network, from the config (and `run_dir`'s files)."""
        return "see the `method` section of config.json"

    def export_problem(self, cfg: Config, fmt: str) -> str | None:
        """Why this config's model cannot be exported as `fmt`, one of `export_formats` (None: it can)."""
        return None

    def open_clip_preprocess(self, cfg: Config) -> dict[str, Any]:
        """For "open_clip" in `export_formats`: open_clip's preprocessing settings (`PreprocessCfg` keys: size,
        mean, std, interpolation, resize_mode) of this config's model."""
        raise NotImplementedError

    def open_clip_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> OpenClipFolder:
        """For "open_clip" in `export_formats`: `model` (fp32, eval mode) as open_clip's model config and state
        dict; files open_clip reads besides them (a Hugging Face text tower's config, a tokenizer) go into `out`."""
        raise NotImplementedError

    def transformers_export(self, model: nn.Module, cfg: Config, run_dir: Path, out: Path) -> None:
        """For "transformers" in `export_formats`: write `model` (fp32, eval mode) into `out` as a folder
        `transformers.AutoModel.from_pretrained` loads, with its tokenizer and image processor."""
        raise NotImplementedError

    def official_export(self, cfg: Config, state: dict[str, torch.Tensor], run_dir: Path, out: Path) -> OfficialFolder:
        """For "official" in `export_formats`: write the weights `state` (of `run_dir`'s model) into `out` as the
        method's official code reads them, with what else it reads there (tokenizer, architecture)."""
        raise NotImplementedError

    def train_data(self, cfg: Config, run_dir: Path, *, rank: int, world_size: int) -> BatchStream:
        """The training batch stream of this rank (a `mmpt.data.loader.BatchStream`)."""
        raise NotImplementedError

    def check_config(self, cfg: Config) -> None:
        """Cross-section checks the schema cannot express; raise ValueError naming the keys."""

    def engine_needs(self, model: nn.Module, cfg: Config) -> EngineNeeds:
        """What this method needs from the engine for `model` built from `cfg` (the one place the engine learns it)."""
        return EngineNeeds()

    def training_step(
        self, model: nn.Module, loss: nn.Module, batch: dict[str, Any], pool: Any = None, index: int = 0
    ) -> dict[str, Any]:
        """One micro-batch (`index` of the step, `pool` from `EngineNeeds.step_pool`): named loss terms to sum,
        and optionally, under the key "train", a dict of diagnostics: device tensors without gradient, logged as
        train/<name> and averaged like the losses, neither summed nor backpropagated.

        The rule for parameters: `training_step` and the step pool are the only method code that computes
        with the model's parameters during training. The engine runs both inside DeepSpeed's forward,
        where ZeRO-3 gathers what they read; anything that reads parameters after the optimizer step
        is an `AfterStep` that names them in `reads`. Under ZeRO-3 the engine checks the first step for
        a parameter used while partitioned and stops with its name.
        """
        raise NotImplementedError

    def evaluate_set(
        self, model: nn.Module, cfg: Config, run_dir: Path, eval_set: EvalSetConfig, language: str, final: bool
    ) -> dict[str, Any]:
        """One `data.eval` set in one language (a task of `eval_tasks`) as a CLIP_benchmark-style record
        (`eval_record`, its metrics under "metrics"), with `model` in eval mode, during training (the engine restores
        modes and RNG afterwards) or at its end (`final`: where a method runs a costlier protocol)."""
        raise NotImplementedError


@runtime_checkable
class ZeroShotMethod(Protocol):
    """A method whose models `mmpt-zeroshot` evaluates (image-text and video-text ones)."""

    def zeroshot(
        self, model: nn.Module, cfg: Config, run_dir: Path, dataset: str, language: str, **options: Any
    ) -> Any: ...


def count(number: int, word: str) -> str:
    """ "1 layer", "2 layers": for the model card's `architecture` paragraph."""
    return f"{number} {word}{'' if number == 1 else 's'}"


def copy_tokenizer(run_dir: Path, name: str, source: str | None) -> None:
    """Copy `source` (the file `method.tokenizer` names, or the one that came with the initial weights) into
    the run directory as `name`: a run is self-contained."""
    if source is None:
        raise FileNotFoundError("config key 'method.tokenizer' is not set")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"config key 'method.tokenizer': {path} does not exist")
    target = run_dir / name
    if path.resolve() != target.resolve():
        shutil.copyfile(path, target)


def eval_record(
    run_dir: Path, dataset: str, task: str, language: str, metrics: dict[str, Any], **details: Any
) -> dict[str, Any]:
    """A CLIP_benchmark-style result; retrieval results say how their ranks treat ties."""
    from mmpt.eval.retrieval import RANK_TIES

    result = {
        "dataset": dataset,
        "model": str(run_dir),
        "task": task,
        "language": language,
        "metrics": metrics,
        **details,
    }
    if "retrieval" in task:
        result["rank_ties"] = RANK_TIES
    return result


def refuse_several_languages(index: int, eval_set: EvalSetConfig, why: str) -> None:
    """A set read in one language only would report the same figures under each of several `languages` labels:
    refused in one line naming the key. `why` follows the key's value in the message."""
    if len(eval_set.languages) > 1:
        raise ValueError(
            f"data.eval.{index}.languages {eval_set.languages}{why}; name one language, the label of its results "
            f"(e.g. languages: [{eval_set.languages[0]}])"
        )


def save_eval_record(record: dict[str, Any], folder: Path, name: str | None = None) -> Path:
    """Write `record` as `<task>_<name>_<language>.json` in `folder`. `name`: a run's evaluation set, its
    `data.eval` name (distinct within a config, so two sets read from one file keep their own records); without
    one, the dataset's name and a hash of its path, so two datasets whose folders have the same name get
    different files. A shard pattern's braces, commas and wildcards become `_` in the file's name."""

    def plain(text: str) -> str:
        return re.sub(r"[^\w.-]+", "_", text).strip("_")

    if name is None:
        dataset = str(record["dataset"])
        name = f"{plain(Path(dataset).stem)}_{hashlib.sha1(os.path.abspath(dataset).encode()).hexdigest()[:6]}"
    name = plain(name)
    path = Path(folder) / f"{record['task']}_{name}_{record['language']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def stream_spec(cfg: Config, *, rank: int, world_size: int) -> StreamSpec:
    """The training stream of `cfg.data.train` for one rank (shared by every method)."""
    from mmpt.data.loader import Source, StreamSpec

    train = cfg.data.train
    return StreamSpec(
        sources=[
            Source.from_pattern(s.shards, s.weight, name=s.name or s.shards, fields=s.sample_fields())
            for s in train.sources
        ],
        batch_size=train.batch_size,
        per_source=train.compose == "per_source",
        seed=cfg.train.seed,
        mode=train.mode,
        shuffle_buffer=train.shuffle_buffer,
        rank=rank,
        world_size=world_size,
        num_workers=train.num_workers,
    )

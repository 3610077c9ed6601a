"""The model card: the README.md written into every release folder (by `mmpt.release.save_release`) and
every export folder.

It says what the model is (method, architecture, parameter count), what it was trained on and for how
long, the evaluations its run recorded, what it is meant for, and how to load it with mmpt,
onnxruntime and, where the model is one open_clip can build, open_clip. Everything in it comes from
the config and the run's own records: `metrics.jsonl` (training steps, samples, evaluations),
`summary.json` (samples per source) and `eval/*.json` (CLIP_benchmark-style results). A release keeps
those facts in its config.json (`"training"`), so a release saved or exported again keeps its card.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mmpt.artifacts import RELEASE_CONFIG
from mmpt.config import Config
from mmpt.export.formats import FORMATS, format_problem, supported_formats
from mmpt.export.towers import tower_names
from mmpt.methods import get_method
from mmpt.models.locking import TowerLocks

CARD = "README.md"
MAX_EVALUATION_COLUMNS = 8  # evaluation steps shown side by side; metrics.jsonl keeps every one


# --- what the run recorded -------------------------------------------------------------------------


def _is_metric(key: str, value: Any) -> bool:
    return (
        key != "step"
        and not key.endswith("seconds")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def run_record(run_dir: Path) -> dict[str, Any] | None:
    """The training facts of a run directory (None if it has no metrics.jsonl)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    training = [line for line in lines if "lr" in line]  # a training step's line; evaluations have no lr
    last = training[-1] if training else {}
    evaluations: list[dict[str, Any]] = []
    for line in lines:
        if "lr" in line:
            continue
        found = {key: value for key, value in line.items() if _is_metric(key, value)}
        if found and not (evaluations and evaluations[-1] == {"step": line["step"], "metrics": found}):
            evaluations.append({"step": line["step"], "metrics": found})
    per_source: dict[str, int] = {}
    parameters: dict[str, int] = {}
    summary = run_dir / "summary.json"
    if summary.is_file():
        written = json.loads(summary.read_text())
        per_source = {
            name: counts.get("decoded", 0) for name, counts in written.get("data", {}).items() if name != "all"
        }
        parameters = written.get("parameters", {})
    records = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        metrics_found = {key: value for key, value in record.get("metrics", {}).items() if _is_metric(key, value)}
        records.append(
            {
                "task": record.get("task"),
                "dataset": record.get("dataset"),
                "language": record.get("language"),
                "metrics": metrics_found,
            }
        )
    return {
        "steps": last.get("step", 0),
        "samples": last.get("data/decoded"),
        "skipped": last.get("data/skipped"),
        "samples_per_source": per_source,
        "parameters": parameters,
        "evaluations": evaluations,
        "eval_records": records,
    }


def training_record(files_from: Path) -> dict[str, Any] | None:
    """The facts of the run a model comes from: the run's own records, or those a release carries."""
    record = run_record(files_from)
    if record is not None:
        return record
    release = files_from / RELEASE_CONFIG
    if release.is_file():
        try:
            return json.loads(release.read_text()).get("training")
        except (json.JSONDecodeError, AttributeError):
            return None
    return None


# --- what the model is --------------------------------------------------------------------------------


def parameter_counts(cfg: Config, files_from: Path, state_dict: dict[str, torch.Tensor]) -> tuple[int, int | None]:
    """(parameters, trainable parameters) of the model, built on the meta device (no memory, no weights).
    When the model cannot be built there: every floating-point tensor of the weights, trainable unknown."""
    try:
        with torch.device("meta"):
            model = get_method(cfg.method_name).build_model(cfg, files_from)
        total = sum(p.numel() for p in model.parameters())
        return total, sum(p.numel() for p in model.parameters() if p.requires_grad)
    except Exception:  # a model whose construction needs real tensors: count the weights instead
        return sum(t.numel() for t in state_dict.values() if t.is_floating_point()), None


def parameter_text(cfg: Config, parameters: tuple[int, int | None], record: dict[str, Any] | None) -> str:
    """The parameters of the model in this folder and what of them trained: as the run counted it where it left a
    count (LoRA adapters and locked towers change it), else as the config builds the model."""
    total, trainable = parameters
    counted = (record or {}).get("parameters") or {}
    trained, adapters = counted.get("trained", trainable), counted.get("adapters", 0)
    if trained is None:
        return f"{total:,}"
    notes = []
    if adapters:
        merged = getattr(cfg.method, "lora", None) is None  # the export folded the adapters into the weights
        notes.append(f"{adapters:,} of them in LoRA adapters{', merged into these weights' if merged else ''}")
    locked = cfg.method.locked() if isinstance(cfg.method, TowerLocks) else {}
    notes += [f"the {tower} tower locked by `method.lock_{tower}: {kept}`" for tower, kept in locked.items()]
    if trained == total and not notes:
        return f"{total:,} (all trainable)"
    return f"{total:,} ({'; '.join([f'{trained:,} trained', *notes])})"


def architecture(cfg: Config, files_from: Path) -> str:
    """One paragraph describing the network, from the config (the method's `architecture`)."""
    return get_method(cfg.method_name).architecture(cfg, files_from)


def intended_use(cfg: Config) -> str:
    return (
        get_method(cfg.method_name).intended_use
        + "(see Training data). It is known to do only what the evaluation above measured: check it on your own "
        "data before relying on it. It inherits the biases of its training data; it is not meant for decisions "
        "about people. A model trained on mmpt's demo corpora (digits, moving digits, toy dialogs) is a toy: it "
        "shows that the pipeline works, not a model to use."
    )


# --- rendering ---------------------------------------------------------------------------------------------


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def training_section(cfg: Config, record: dict[str, Any] | None) -> str:
    train, data = cfg.train, cfg.data.train
    lines = ["## Training data", ""]
    if record is None:
        lines.append(
            "No training record: this model was not saved from an mmpt training run (for instance, converted "
            "official weights, or a model saved before training)."
        )
    else:
        samples = record.get("samples")
        skipped = record.get("skipped")
        per_source = record.get("samples_per_source") or {}
        lines += ["| source | weight | samples trained on |", "|---|---|---|"]
        for source in data.sources:
            name = source.name or source.shards
            # one source: the run counts its samples in the totals alone
            count = samples if len(data.sources) == 1 else per_source.get(name)
            shards = f" (`{source.shards}`)" if source.name else ""
            lines.append(f"| `{name}`{shards} | {source.weight:g} | {_number(count) if count is not None else '-'} |")
        steps = record.get("steps", 0)
        below = "; the run ended in warmup, that lr not reached" if steps < cfg.optim.warmup_steps else ""
        lines += [
            "",
            f"- steps: {_number(steps)} (of `train.max_steps` {_number(train.max_steps)})",
            f"- samples trained on: {_number(samples) if samples is not None else 'not recorded'}"
            + (f" ({_number(skipped)} skipped as unusable)" if skipped else ""),
            f"- batch: {data.batch_size} per rank x {train.grad_accum} micro-batch(es) per step; precision "
            f"{train.precision}, ZeRO stage {train.zero_stage}",
            f"- optimizer: AdamW, lr {cfg.optim.lr:g} ({cfg.optim.warmup_steps} warmup steps, then {cfg.optim.decay} "
            f"decay{below}), weight decay {cfg.optim.weight_decay:g}",
            *(f"- {line}" for line in get_method(cfg.method_name).summary_lines(cfg)),
        ]
    init = getattr(cfg.method, "init_from", None) or getattr(cfg.method, "encoder", None)
    if init:
        lines.append(f"- initial weights: `{init}`")
    return "\n".join(lines)


def evaluation_section(record: dict[str, Any] | None) -> str:
    lines = ["## Evaluation", ""]
    evaluations = (record or {}).get("evaluations") or []
    eval_records = (record or {}).get("eval_records") or []
    if not evaluations and not eval_records:
        lines.append("No evaluation was recorded for this model.")
        return "\n".join(lines)
    if evaluations:
        shown = evaluations[-MAX_EVALUATION_COLUMNS:]
        keys: list[str] = []
        for evaluation in evaluations:
            keys += [key for key in evaluation["metrics"] if key not in keys]
        last = len(shown) - 1
        heads = [f"step {e['step']}" + (" (final)" if i == last else "") for i, e in enumerate(shown)]
        lines += [
            "The run's evaluations (`metrics.jsonl`), while training and at its end"
            + (f"; the last {len(shown)} of {len(evaluations)} shown" if len(shown) < len(evaluations) else "")
            + ":",
            "",
            "| metric | " + " | ".join(heads) + " |",
            "|---|" + "---|" * len(shown),
        ]
        for key in keys:
            values = [_number(e["metrics"][key]) if key in e["metrics"] else "-" for e in shown]
            lines.append(f"| `{key}` | " + " | ".join(values) + " |")
    if eval_records:
        lines += [
            "",
            "Results written at the end of training (`eval/*.json`, CLIP_benchmark style):",
            "",
            "| task | dataset | language | metrics |",
            "|---|---|---|---|",
        ]
        for r in eval_records:
            metrics = ", ".join(f"{k}={_number(v)}" for k, v in r["metrics"].items())
            lines.append(f"| {r['task']} | `{r['dataset']}` | {r['language']} | {metrics} |")
    return "\n".join(lines)


def mmpt_usage(cfg: Config, folder: str) -> str:
    towers = tower_names(cfg)
    code = ["import mmpt", f"model = mmpt.load({json.dumps(folder)})", "pre = model.preprocessors()"]
    if "dialog" in towers:
        code += [
            'dialogs = [[{"role": "user", "text": "I lost my card"}]]',
            'features = model.encode_dialog(pre["tokenizer"](dialogs))',
        ]
    else:
        code += [
            'tokens = pre["tokenizer"](["a photo of a cat"])',
            'text = model.encode_text(tokens["input_ids"], tokens["attention_mask"])',
        ]
        if "video" in towers:
            code.append('video = model.encode_video(pre["video"](open("clip.mp4", "rb").read()).unsqueeze(0))')
        else:
            code.insert(0, "from PIL import Image")
            code += [
                'image = model.encode_image(pre["preprocess"](Image.open("photo.jpg").convert("RGB")).unsqueeze(0))',
                "print(image @ text.T)",
            ]
    return "\n".join(["```python", *code, "```"])


def open_clip_name(out: str | Path) -> str:
    """The name an open_clip export registers its model config under: `mmpt-<folder name>`."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(out).resolve().name).strip("-") or "model"
    return f"mmpt-{stem}"


def open_clip_preprocess(cfg: Config) -> dict[str, Any]:
    """open_clip's preprocessing settings (PreprocessCfg keys) of a model that exports to open_clip."""
    return get_method(cfg.method_name).open_clip_preprocess(cfg)


EVAL_LINE = "model.eval()  # open_clip returns the model in training mode (batch norm, dropout)"


def open_clip_lines(out: str, cfg: Config) -> list[str]:
    """The lines that load an open_clip export with open_clip (its model config registered first), and its
    tokenizer. open_clip takes preprocessing from a pretrained tag, not from a model config: settings other
    than its defaults are passed to create_model_and_transforms."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    name = open_clip_name(out)
    pre = open_clip_preprocess(cfg)
    kwargs = ""
    if pre["mean"] != [float(v) for v in OPENAI_DATASET_MEAN] or pre["std"] != [float(v) for v in OPENAI_DATASET_STD]:
        kwargs += f", image_mean={tuple(pre['mean'])}, image_std={tuple(pre['std'])}"
    if pre["interpolation"] != "bicubic":
        kwargs += f', image_interpolation="{pre["interpolation"]}"'
    if pre["resize_mode"] != "shortest":
        kwargs += f', image_resize_mode="{pre["resize_mode"]}"'
    return [
        "import open_clip",
        f'open_clip.add_model_config("{out}/{name}.json")',
        f'model, _, preprocess = open_clip.create_model_and_transforms("{name}", '
        f'pretrained="{out}/open_clip_model.safetensors"{kwargs})',
        EVAL_LINE,
        f'tokenizer = open_clip.get_tokenizer("{name}")',
    ]


def transformers_lines(out: str, cfg: Config) -> list[str]:
    """The lines that load a transformers export with transformers."""
    remote = get_method(cfg.method_name).transformers_code
    trust = ", trust_remote_code=True" if remote else ""
    lines = [
        "```python",
        "from transformers import AutoImageProcessor, AutoModel, AutoTokenizer",
        f'model = AutoModel.from_pretrained("{out}"{trust})',
        f'tokenizer = AutoTokenizer.from_pretrained("{out}"{trust})',
        f'processor = AutoImageProcessor.from_pretrained("{out}", backend="pil")',
    ]
    if remote:
        return [*lines, "```", "", "The folder carries the model's own code (it imports nothing of mmpt)."]
    return [  # the embeddings mmpt computes: padded to the context length as in training, L2-normalised
        *lines,
        "import torch",
        "from PIL import Image",
        "with torch.no_grad():",
        '    text = tokenizer(["a photo of a cat"], padding="max_length", truncation=True, return_tensors="pt")',
        "    text_features = model.get_text_features(**text).pooler_output",
        '    pixels = processor(images=[Image.open("cat.jpg")], return_tensors="pt")',
        "    image_features = model.get_image_features(**pixels).pooler_output",
        "text_features = torch.nn.functional.normalize(text_features, dim=-1)  # as mmpt's embeddings",
        "image_features = torch.nn.functional.normalize(image_features, dim=-1)",
        "```",
    ]


def release_usage(cfg: Config, folder: str) -> str:
    """How to load a release: mmpt, then the other formats it exports to."""
    lines = ["## How to use it", "", "### With mmpt", "", mmpt_usage(cfg, folder)]
    formats = supported_formats(cfg)

    def export(fmt: str, heading: str, *about: str) -> list[str]:
        command = f"python launch/export.py --run {folder} --out {folder}-{fmt} --format {fmt}"
        return ["", f"### {heading}", "", *about, "```bash", command, "```"]

    if "onnx" in formats:
        about = (
            f"Export the towers ({', '.join(tower_names(cfg))}) to ONNX; the folder it writes holds one `.onnx` file "
            "per tower, `preprocessing.json` (input names, dtypes, shapes, image size, mean/std, tokenizer) and the "
            "tokenizer files, and its README.md shows the onnxruntime calls:"
        )
        lines += export("onnx", "With onnxruntime", about, "")
    if "open_clip" in formats:
        python = ["```python", *open_clip_lines(f"{folder}-open_clip", cfg), "```"]
        lines += [*export("open_clip", "With open_clip"), "", *python]
    elif tower_names(cfg):
        lines += ["", "### With open_clip", "", f"Not available: {format_problem(cfg, 'open_clip')}."]
    if "transformers" in formats:
        lines += [*export("transformers", "With transformers"), "", *transformers_lines(f"{folder}-transformers", cfg)]
    if "official" in formats:
        layout = get_method(cfg.method_name).official_layout
        lines += [*export("official", "In the official layout"), "", f"writes {layout}."]
    return "\n".join(lines)


def render(
    cfg: Config,
    *,
    title: str,
    kind: str,
    parameters: tuple[int, int | None],
    record: dict[str, Any] | None,
    usage: str,
    files: list[tuple[str, str]],
    files_from: Path,
) -> str:
    """The card's Markdown. `kind` is the format of the folder (a key of FORMATS); `usage` its "How to use it"
    section; `files` (name, what it is) of the folder; `files_from` the run or release it was made from."""
    summary = [
        f"# {title}",
        "",
        "<!-- model card written by mmpt (mmpt/export/card.py) from the run's config and records -->",
        "",
        "| | |",
        "|---|---|",
        f"| method | `{cfg.method_name}` |",
        f"| architecture | {architecture(cfg, files_from)} |",
        f"| parameters | {parameter_text(cfg, parameters, record)} |",
        f"| this folder | {FORMATS[kind]} |",
        f"| exports | {', '.join(supported_formats(cfg))} (`launch/export.py --format`) |",
    ]
    file_lines = ["## Files", "", "| file | what it is |", "|---|---|"]
    file_lines += [f"| `{name}` | {about} |" for name, about in files]
    sections = [
        "\n".join(summary),
        training_section(cfg, record),
        evaluation_section(record),
        "## Intended use\n\n" + intended_use(cfg),
        usage,
        "\n".join(file_lines),
    ]
    return "\n\n".join(sections) + "\n"


def write_card(
    out: Path,
    cfg: Config,
    files_from: Path,
    state: dict[str, torch.Tensor],
    *,
    title: str,
    kind: str,
    usage: Sequence[str],
    files: Sequence[tuple[str, str]],
) -> None:
    """An export folder's README.md: `title` after the folder's name, `usage` under "How to use it", `files` and
    this card; the record and parameter counts come from `files_from`, the run or release exported."""
    card = render(
        cfg,
        title=f"{out.resolve().name}: {title}",
        kind=kind,
        parameters=parameter_counts(cfg, files_from, state),
        record=training_record(files_from),
        usage="\n".join(["## How to use it", "", *usage]),
        files=[*files, (CARD, "this card")],
        files_from=files_from,
    )
    (out / CARD).write_text(card, encoding="utf-8")


def release_card(
    directory: Path, cfg: Config, state_dict: dict[str, torch.Tensor], files_from: Path, record: dict | None
) -> str:
    """The card of a release folder."""
    files = [
        (RELEASE_CONFIG, 'the format, the method and the full config (`"config"`), the training facts (`"training"`)'),
        ("model.safetensors", "the weights, fp32 (or shards and `model.safetensors.index.json`)"),
        *(
            (name, "what the model needs besides weights (tokenizer, model config)")
            for name in get_method(cfg.method_name).release_files(cfg)
        ),
        (CARD, "this card"),
    ]
    return render(
        cfg,
        title=f"{directory.resolve().name}: an mmpt `{cfg.method_name}` model",
        kind="release",
        parameters=parameter_counts(cfg, files_from, state_dict),
        record=record,
        usage=release_usage(cfg, str(directory)),
        files=files,
        files_from=files_from,
    )

"""`--format onnx`: one ONNX file per tower, the input contract (`preprocessing.json`) and the tokenizer
files beside them, and a README.md (the model card with the contract and the onnxruntime calls).

Each tower is exported with torch's exporter (`torch.onnx.export`, dynamo) from the model's own
`encode_*` method, so the graph computes what mmpt computes: fp32, L2-normalised features. The batch
axis is dynamic; so is the sequence axis of every text or dialog tower that reads a padding mask.
Weights are inside the .onnx file, or beside it in `<tower>.onnx.data` past 1.5 GB (protobuf's 2 GB
limit). After writing, each file is read back with onnxruntime and run on a batch size (and length)
other than the one it was traced with; outputs must equal mmpt's within `TOLERANCE`.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.config import Config
from mmpt.export.card import mmpt_usage, write_card
from mmpt.export.formats import LoadedModel
from mmpt.export.towers import BATCH, SEQUENCE, Tower, towers
from mmpt.methods import get_method

CONTRACT = "preprocessing.json"
TOLERANCE = 1e-4  # largest |onnxruntime - mmpt| accepted on the check after export (fp32 features)
EXTERNAL_DATA_BYTES = 1.5 * 2**30


def missing_packages(check: bool) -> list[str]:
    """The packages of the `onnx` extra an export needs and this environment lacks (onnxruntime only to check)."""
    import importlib.util

    needed = ["onnx", "onnxscript", *(["onnxruntime"] if check else [])]
    return [name for name in needed if importlib.util.find_spec(name) is None]


# --- the contract: how raw inputs become tower inputs ---------------------------------------------------------


def describe_image_transform(transform: Any) -> list[dict[str, Any]]:
    """A torchvision evaluation transform (mmpt's `preprocess`) as a list of steps anyone can re-implement."""
    steps: list[dict[str, Any]] = []
    for step in getattr(transform, "transforms", [transform]):
        kind = type(step).__name__
        if kind == "Resize":
            size = [step.size] if isinstance(step.size, int) else [int(v) for v in step.size]
            square = len(size) == 2
            steps.append(
                {
                    "op": "resize",
                    "size": size if square else size[0],
                    "interpolation": step.interpolation.value,
                    "antialias": bool(step.antialias),
                    "about": "to exactly [height, width], aspect ratio not kept"
                    if square
                    else "the shorter side to `size`, aspect ratio kept",
                }
            )
        elif kind == "CenterCrop":
            steps.append({"op": "center_crop", "size": list(step.size), "about": "the central [height, width]"})
        elif kind == "CenterCropFloor":
            steps.append(
                {
                    "op": "center_crop",
                    "size": [step.height, step.width],
                    "offsets": "floor",
                    "about": "the central [height, width], its offsets rounded down (transformers' processors)",
                }
            )
        elif kind in ("MaybeConvertMode", "_convert_to_rgb") or getattr(step, "__name__", "") == "_convert_to_rgb":
            steps.append({"op": "convert_rgb", "about": 'PIL image.convert("RGB")'})
        elif kind == "PILToTensor":
            steps.append({"op": "pil_to_tensor", "about": "HWC uint8 RGB -> CHW uint8, not scaled"})
        elif kind in ("ToTensor", "MaybeToTensor"):
            steps.append({"op": "to_tensor", "about": "HWC uint8 RGB -> CHW float32, divided by 255"})
        elif kind == "Normalize":
            steps.append(
                {
                    "op": "normalize",
                    "mean": [float(v) for v in step.mean],
                    "std": [float(v) for v in step.std],
                    "about": "per channel: (x - mean) / std",
                }
            )
        else:
            steps.append({"op": kind, "about": repr(step)})
    return steps


def torchvision_code(steps: list[dict[str, Any]]) -> str:
    """Python (torchvision) that applies `steps` to a PIL image, as the README shows it."""
    parts = []
    for step in steps:
        if step["op"] == "resize":
            mode = f"T.InterpolationMode.{step['interpolation'].upper()}"
            size = tuple(step["size"]) if isinstance(step["size"], list) else step["size"]
            parts.append(f"T.Resize({size}, interpolation={mode}, antialias={step['antialias']})")
        elif step["op"] == "center_crop" and step.get("offsets") == "floor":
            h, w = step["size"]
            left, top = f"(i.width - {w}) // 2", f"(i.height - {h}) // 2"
            parts.append(f"T.Lambda(lambda i: i.crop(({left}, {top}, {left} + {w}, {top} + {h})))")
        elif step["op"] == "center_crop":
            parts.append(f"T.CenterCrop({tuple(step['size'])})")
        elif step["op"] == "convert_rgb":
            parts.append('T.Lambda(lambda image: image.convert("RGB"))')
        elif step["op"] == "pil_to_tensor":
            parts.append("T.PILToTensor()")
        elif step["op"] == "to_tensor":
            parts.append("T.ToTensor()")
        elif step["op"] == "normalize":
            parts.append(f"T.Normalize({step['mean']}, {step['std']})")
        else:
            parts.append(f"...  # {step['op']}: {step['about']}")
    return "T.Compose([\n    " + ",\n    ".join(parts) + ",\n])"


def describe_tokenizer(model: LoadedModel, out: Path) -> dict[str, Any]:
    """The text tokenizer's contract; copies the files it needs into `out`."""
    from mmpt.data.tokenizer import TextTokenizer
    from mmpt.models.m2_remote.glm_tokenizer import GLMTokenizer
    from mmpt.models.open_clip_model import OpenClipTokenizer
    from mmpt.models.transformers_dual import TransformersTokenizer

    tokenizer = model.preprocessors()["tokenizer"]
    if isinstance(tokenizer, TransformersTokenizer):
        tokenizer._tokenizer.save_pretrained(out / "tokenizer")
        return huggingface_tokenizer(tokenizer.context_length)
    if isinstance(tokenizer, TextTokenizer):
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        pad = tokenizer._tokenizer.padding["pad_id"] if tokenizer._tokenizer.padding else 0
        return {
            "kind": "tokenizers",
            "files": ["tokenizer.json"],
            "context_length": tokenizer.context_length,
            "pad_id": pad,
            "about": "a `tokenizers` tokenizer.json (it adds [CLS] ... [SEP] itself): truncate to context_length, "
            "pad on the right with pad_id to context_length; attention_mask 1 on tokens, 0 on padding",
        }
    if isinstance(tokenizer, GLMTokenizer):
        name = "sp.model"
        shutil.copyfile(tokenizer.model_file, out / name)
        return {
            "kind": "glm-sentencepiece",
            "files": [name],
            "context_length": tokenizer.context_length,
            "pad_id": tokenizer.pad_id,
            "about": "the official M2-Encoder GLM SentencePiece tokenizer: literal [CLS], <|endoftext|>, [MASK], "
            "[UNK] cut out as their own ids; runs of 2-10 spaces as <|blank_n|>; SentencePiece on the rest; "
            "[CLS] + the last context_length - 2 ids + <|endoftext|>, right-padded with pad_id; "
            "mmpt.models.m2_remote.glm_tokenizer.GLMTokenizer implements it",
        }
    if isinstance(tokenizer, OpenClipTokenizer):
        from open_clip.tokenizer import HFTokenizer, SimpleTokenizer, default_bpe

        inner = tokenizer._tokenizer
        if isinstance(inner, SimpleTokenizer):
            shutil.copyfile(default_bpe(), out / Path(default_bpe()).name)
            return {
                "kind": "open_clip-simple",
                "files": [Path(default_bpe()).name],
                "context_length": inner.context_length,
                "pad_id": 0,
                "about": "open_clip's SimpleTokenizer (CLIP BPE): lower-cased, <start_of_text> ... <end_of_text>, "
                "truncated and zero-padded to context_length",
            }
        if isinstance(inner, HFTokenizer):
            inner.save_pretrained(out / "tokenizer")
            return huggingface_tokenizer(inner.context_length)
        return {"kind": type(inner).__name__, "files": [], "about": f"open_clip.get_tokenizer({tokenizer.model!r})"}
    return {"kind": type(tokenizer).__name__, "files": [], "about": "see the method's preprocessors()"}


def huggingface_tokenizer(context_length: int | None) -> dict[str, Any]:
    return {
        "kind": "huggingface",
        "files": ["tokenizer/"],
        "context_length": context_length,
        "about": "a Hugging Face tokenizer (AutoTokenizer.from_pretrained('tokenizer')), padded to "
        "max_length=context_length and truncated",
    }


def contract(model: LoadedModel, built: list[Tower], out: Path, opset: int) -> dict[str, Any]:
    cfg = model.config
    record: dict[str, Any] = {
        "format": "mmpt-onnx",
        "version": 1,
        "method": cfg.method_name,
        "opset": opset,
        "towers": {
            tower.name: {
                "file": tower.file,
                "inputs": [spec.as_dict() for spec in tower.inputs],
                "outputs": [tower.output.as_dict()],
                "dynamic_axes": {
                    BATCH: "any size",
                    **({SEQUENCE: f"2 to {tower.max_sequence}"} if tower.dynamic_sequence else {}),
                },
            }
            for tower in built
        },
    }
    names = {tower.name for tower in built}
    if "image" in names:
        steps = describe_image_transform(model.preprocessors()["preprocess"])
        normalize = next((s for s in steps if s["op"] == "normalize"), {})
        record["image"] = {
            "input": "an RGB image (PIL)",
            "size": next(t for t in built if t.name == "image").inputs[0].shape[-1],
            "mean": normalize.get("mean"),
            "std": normalize.get("std"),
            "steps": steps,
            "layout": "NCHW float32",
        }
    method = get_method(cfg.method_name)
    # how the raw inputs of the method's other towers become tensors (a tower's entry only if it is exported)
    extra = method.input_contract(cfg, model.files_from, out)
    record.update({key: value for key, value in extra.items() if key not in method.tower_names or key in names})
    if "text" in names:
        record["tokenizer"] = describe_tokenizer(model, out)
    return record


# --- export and check --------------------------------------------------------------------------------------------


def _dynamic_shapes(tower: Tower) -> dict[str, dict[int, Any]]:
    from torch.export import Dim

    batch = Dim(BATCH, min=1, max=2**20)
    sequence = Dim(SEQUENCE, min=2, max=tower.max_sequence) if tower.dynamic_sequence else None
    shapes = {}
    for spec in tower.inputs:
        axes = {i: batch if d == BATCH else sequence for i, d in enumerate(spec.shape) if d in (BATCH, SEQUENCE)}
        shapes[spec.name] = axes
    return shapes


def _model_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def export_tower(tower: Tower, path: Path) -> int:
    """Write `tower` as ONNX at `path`; returns the opset used."""
    import onnx

    tower.module.eval()
    example = tower.example(2, tower.max_sequence if tower.dynamic_sequence else None)
    external = _model_bytes(tower.module) > EXTERNAL_DATA_BYTES
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                tower.module,
                example,
                dynamo=True,
                input_names=[spec.name for spec in tower.inputs],
                output_names=[tower.output.name],
                dynamic_shapes=_dynamic_shapes(tower),
                verbose=False,
            )
    finally:
        quiet.setLevel(level)
    assert program is not None
    program.save(str(path), external_data=external)
    graph = onnx.load(str(path), load_external_data=False)
    for value, spec in zip(graph.graph.input, tower.inputs):
        dims = value.type.tensor_type.shape.dim
        fixed = [str(spec.shape[i]) for i, d in enumerate(dims) if spec.shape[i] in (BATCH, SEQUENCE) and d.dim_value]
        if fixed:  # the tracer turned a dynamic axis into a constant: the file would refuse other sizes
            raise RuntimeError(f"{path.name}: input {spec.name!r} lost its dynamic {', '.join(fixed)} axis on export")
    return max((o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")), default=0)


def check_tower(tower: Tower, path: Path) -> float:
    """Largest |onnxruntime - mmpt| on inputs of other sizes than the traced ones (batch 3, and a shorter
    sequence where it is dynamic); RuntimeError past TOLERANCE."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sequence = max(2, (tower.max_sequence or 2) // 2 + 1) if tower.dynamic_sequence else None
    inputs = tower.example(3, sequence, seed=1)
    with torch.no_grad():
        expected = tower.module(*inputs).numpy()
    got = session.run(None, {spec.name: x.numpy() for spec, x in zip(tower.inputs, inputs)})[0]
    error = float(abs(got - expected).max())
    if not error <= TOLERANCE:
        raise RuntimeError(f"{path.name}: onnxruntime differs from mmpt by {error:.2e} (more than {TOLERANCE:g})")
    return error


def export_onnx(model: LoadedModel, out: Path, names: list[str], check: bool = True) -> list[Path]:
    """Write the towers `names` of `model` (a loaded release or run) and their contract into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.model.float().eval()
    built = towers(model.model, model.config, names)
    written, opset = [], 0
    for tower in built:
        path = out / tower.file
        opset = export_tower(tower, path)
        if check:
            check_tower(tower, path)
        written.append(path)
    record = contract(model, built, out, opset)
    (out / CONTRACT).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    write_onnx_card(model, built, record, out)
    return written


# --- the README ----------------------------------------------------------------------------------------------------


def _shape(spec_shape: list) -> str:
    return "[" + ", ".join(str(d) for d in spec_shape) + "]"


def onnxruntime_code(record: dict[str, Any], out: Path) -> str:
    """The calls that turn raw inputs into features with onnxruntime, from the contract (a photo.jpg, clip.mp4
    or dialog and one caption as the example inputs)."""
    imports = ["import numpy as np", "import onnxruntime as ort"]
    lines = ["", f"folder = {json.dumps(str(out))}"]
    towers_ = record["towers"]
    if "image" in towers_:
        imports += ["from PIL import Image", "from torchvision import transforms as T"]
        lines += [
            f"preprocess = {torchvision_code(record['image']['steps'])}",
            'pixels = preprocess(Image.open("photo.jpg").convert("RGB")).unsqueeze(0).numpy()',
            'image = ort.InferenceSession(f"{folder}/image.onnx", providers=["CPUExecutionProvider"])',
            'image_features = image.run(None, {"pixel_values": pixels})[0]',
        ]
    if "video" in towers_:
        video = record["video"]
        lines += [
            f'# {video["frames"]} frames of clip.mp4, sampled and resized as preprocessing.json\'s "video" says',
            f"video = np.zeros((1, {video['frames']}, 3, {video['size']}, {video['size']}), dtype=np.uint8)",
            'session = ort.InferenceSession(f"{folder}/video.onnx", providers=["CPUExecutionProvider"])',
            'video_features = session.run(None, {"video": video})[0]',
        ]
    tokenizer = record.get("tokenizer", {})
    if "text" in towers_:
        kind = tokenizer.get("kind")
        if kind == "tokenizers":
            length = tokenizer["context_length"]
            imports.append("from tokenizers import Tokenizer")
            lines += [
                'tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")',
                f"tokenizer.enable_truncation({length})",
                f"tokenizer.enable_padding(pad_id={tokenizer['pad_id']}, length={length})",
                'encodings = tokenizer.encode_batch(["a photo of a cat"])',
                "input_ids = np.array([e.ids for e in encodings], dtype=np.int64)",
                "attention_mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)",
            ]
        elif kind == "glm-sentencepiece":
            imports.append(
                "from mmpt.models.m2_remote.glm_tokenizer import GLMTokenizer  # the rules preprocessing.json states"
            )
            lines += [
                f'tokenizer = GLMTokenizer(f"{{folder}}/{tokenizer["files"][0]}", {tokenizer["context_length"]})',
                'tokens = tokenizer(["a photo of a cat"])',
                'input_ids, attention_mask = tokens["input_ids"].numpy(), tokens["attention_mask"].numpy()',
            ]
        elif kind == "open_clip-simple":
            imports.append("from open_clip.tokenizer import SimpleTokenizer")
            lines += [
                f'tokenizer = SimpleTokenizer(f"{{folder}}/{tokenizer["files"][0]}", '
                f"context_length={tokenizer['context_length']})",
                'input_ids = tokenizer(["a photo of a cat"]).numpy()',
            ]
        elif kind == "huggingface":
            imports.append("from transformers import AutoTokenizer")
            lines += [
                'tokenizer = AutoTokenizer.from_pretrained(f"{folder}/tokenizer")',
                'tokens = tokenizer(["a photo of a cat"], padding="max_length", truncation=True, return_tensors="np", '
                f"max_length={tokenizer['context_length']})",
                'input_ids, attention_mask = tokens["input_ids"], tokens["attention_mask"]',
            ]
        else:
            lines.append(f"input_ids = ...  # {tokenizer.get('about')}")
        feeds = ", ".join(f'"{spec["name"]}": {spec["name"]}' for spec in towers_["text"]["inputs"])
        lines += [
            'text = ort.InferenceSession(f"{folder}/text.onnx", providers=["CPUExecutionProvider"])',
            f"text_features = text.run(None, {{{feeds}}})[0]",
        ]
        for other in ("image", "video"):
            if other in towers_:
                lines.append(f"print({other}_features @ text_features.T)")
    if "dialog" in towers_:
        imports += [
            "from transformers import AutoTokenizer",
            "from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec  # the rules in preprocessing.json",
        ]
        lines += [
            f"spec = DialogInputSpec({tokenizer['max_utt_len']}, {tokenizer['max_turns']}, {tokenizer['max_len']})",
            'encoder = DialogEncoder(AutoTokenizer.from_pretrained(f"{folder}/tokenizer"), spec, with_mlm=False)',
            'batch = encoder([[{"role": "user", "text": "I lost my card"}]])',
            'names = ["input_ids", "positions", "turns", "roles", "attention_mask"]',
            "feeds = {name: batch[name].numpy().astype(np.int64) for name in names}",
            'dialog = ort.InferenceSession(f"{folder}/dialog.onnx", providers=["CPUExecutionProvider"])',
            "dialog_features = dialog.run(None, feeds)[0]",
        ]
    return "\n".join(["```python", *imports, *lines, "```"])


def contract_section(record: dict[str, Any]) -> str:
    lines = [
        "### The contract",
        "",
        f"`{CONTRACT}` holds all of it; opset {record['opset']}, fp32, outputs L2-normalised.",
        "",
        "| tower | file | inputs | output | dynamic axes |",
        "|---|---|---|---|---|",
    ]
    for name, tower in record["towers"].items():
        inputs = "<br>".join(f"`{s['name']}` {s['dtype']} {_shape(s['shape'])}" for s in tower["inputs"])
        output = tower["outputs"][0]
        axes = ", ".join(f"{axis}: {extent}" for axis, extent in tower["dynamic_axes"].items())
        lines.append(
            f"| {name} | `{tower['file']}` | {inputs} | `{output['name']}` {output['dtype']} "
            f"{_shape(output['shape'])} | {axes} |"
        )
    if "image" in record:
        image = record["image"]
        steps = "; ".join(
            f"{s['op']}"
            + (f" {s['size']}" if "size" in s else "")
            + (f" ({s['interpolation']})" if "interpolation" in s else "")
            for s in image["steps"]
        )
        lines += ["", f"Images ({image['size']} px): {steps}; mean {image['mean']}, std {image['std']}."]
    if "video" in record:
        video = record["video"]
        lines += [
            "",
            f"Videos: {video['frames']} frames at {video['size']} px; {video['sampling']}; "
            + "; ".join(video["steps"])
            + ".",
        ]
    if "tokenizer" in record:
        tokenizer = record["tokenizer"]
        files = ", ".join(f"`{f}`" for f in tokenizer.get("files", [])) or "none"
        lines += ["", f"Tokenizer ({files}): {tokenizer['about']}."]
    return "\n".join(lines)


def write_onnx_card(model: LoadedModel, built: list[Tower], record: dict[str, Any], out: Path) -> None:
    cfg: Config = model.config
    usage = ["### With onnxruntime", "", onnxruntime_code(record, out), "", contract_section(record), ""]
    usage += ["### With mmpt", "", f"The mmpt model these files come from (`{model.files_from}`) loads with:", ""]
    usage.append(mmpt_usage(cfg, str(model.files_from)))
    files = [(tower.file, f"the {tower.name} tower") for tower in built]
    files += [
        (f"{tower.file}.data", f"the {tower.name} tower's weights")
        for tower in built
        if (out / f"{tower.file}.data").exists()
    ]
    files += [(CONTRACT, "the input contract: names, dtypes, shapes, preprocessing, tokenizer")]
    files += [(name, "tokenizer") for name in record.get("tokenizer", {}).get("files", [])]
    title = f"an mmpt `{cfg.method_name}` model, exported to ONNX"
    write_card(out, cfg, model.files_from, model.model.state_dict(), title=title, kind="onnx", usage=usage, files=files)

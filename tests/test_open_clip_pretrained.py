"""The `open_clip` method from open_clip's weights: a local file in each of open_clip's formats gives the embeddings
open_clip itself gives with them; weights that do not fit, unknown tags and missing files stop before training in
one line naming the key; on two ranks a run from such weights trains with the sigmoid loss, resumes and exports."""

import json
import re

import open_clip
import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, read_metrics
from mmpt.config import ConfigError
from mmpt.engine.preflight import check_inputs
from mmpt.methods import get_method
from mmpt.models.open_clip_model import register_model_config
from pool import scenario

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
TINY_SIGLIP = {**TINY, "init_logit_bias": -10, "init_logit_scale": 2.3}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Architectures registered with open_clip and weights saved by it: a state dict as .pt and .safetensors, an
    open_clip_train checkpoint, and a SigLIP-style model's state dict."""
    root = tmp_path_factory.mktemp("open_clip_weights")
    files = {}
    for name, config in (("tiny-clip", TINY), ("tiny-siglip", TINY_SIGLIP)):
        (root / f"{name}.json").write_text(json.dumps(config))
        open_clip.add_model_config(root / f"{name}.json")
    torch.manual_seed(3)
    reference = open_clip.create_model("tiny-clip", pretrained=None).eval()
    with torch.no_grad():
        reference.logit_scale.fill_(3.0)  # not the initial value, so a load that skipped it shows
    state = reference.state_dict()
    torch.save(state, files.setdefault("pt", root / "tiny.pt"))
    save_file({k: v.contiguous() for k, v in state.items()}, files.setdefault("safetensors", root / "tiny.safetensors"))
    checkpoint = {"epoch": 2, "name": "run", "state_dict": {f"module.{k}": v for k, v in state.items()}}
    torch.save(checkpoint, files.setdefault("open_clip_train", root / "epoch_2.pt"))
    partial = {k: v for k, v in state.items() if k != "text_projection"}
    torch.save(partial, files.setdefault("partial", root / "partial.pt"))
    siglip = open_clip.create_model("tiny-siglip", pretrained=None).eval()
    with torch.no_grad():
        siglip.logit_bias.fill_(-7.5)
    torch.save(siglip.state_dict(), files.setdefault("siglip", root / "siglip.pt"))
    return root, files, reference, siglip


def model_name(root, model):
    """open_clip's own architectures by name, the tiny ones by their JSON file."""
    return str(root / f"{model}.json") if (root / f"{model}.json").exists() else model


def config(root, pretrained, model="tiny-clip", **method):
    from mmpt.config_loader import validate_config

    return validate_config(
        {
            "method": {"name": "open_clip", "model": model_name(root, model), "pretrained": str(pretrained), **method},
            "data": {"train": {"sources": [{"shards": str(root / "*.json")}], "batch_size": 2}},
            "optim": {"lr": 1e-4, "weight_decay": 0.05, "warmup_steps": 0},
            "train": {"max_steps": 1, "zero_stage": 0, "grad_accum": 1, "grad_clip": 1.0},
            "run": {"output_dir": str(root / "run")},
        }
    )


def embeddings(model, images, ids):
    with torch.no_grad():
        return model.encode_image(images, normalize=True), model.encode_text(ids, normalize=True)


@pytest.mark.parametrize("kind", ["pt", "safetensors", "open_clip_train"])
def test_weights_give_open_clips_embeddings(weights, kind):
    root, files, reference, _ = weights
    cfg = config(root, files[kind])
    method = get_method("open_clip")
    method.check_initial_weights(cfg)
    model = method.build_model(cfg, root / "run").eval()
    line = method.load_initial_weights(model, cfg)
    assert line is not None and str(files[kind]) in line
    images, ids = torch.randn(3, 3, 32, 32), open_clip.get_tokenizer("tiny-clip")(["a 7", "zero", "two digits"])
    for ours, theirs in zip(embeddings(model, images, ids), embeddings(reference, images, ids)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert model.clip.logit_scale.item() == 3.0
    assert getattr(model.clip, "logit_bias", None) is None  # contrastive: no bias


def test_a_siglip_architecture_keeps_its_bias_and_trains_with_the_sigmoid_loss(weights):
    from mmpt.losses import GroupedContrastiveLoss, SigmoidLoss

    root, files, _, siglip = weights
    method = get_method("open_clip")
    cfg = config(root, files["siglip"], model="tiny-siglip")
    model = method.build_model(cfg, root / "run")
    method.load_initial_weights(model, cfg)
    assert isinstance(method.build_loss(cfg), SigmoidLoss)
    assert model.clip.logit_bias.item() == -7.5 and model.clip.logit_bias.shape == (1,)
    contrastive = config(root, files["siglip"], model="tiny-siglip", loss={"name": "contrastive"})
    model = method.build_model(contrastive, root / "run")
    method.load_initial_weights(model, contrastive)  # the file's bias is left out: the model has none
    assert isinstance(method.build_loss(contrastive), GroupedContrastiveLoss)
    assert getattr(model.clip, "logit_bias", None) is None
    sigmoid = config(root, files["pt"], loss={"name": "sigmoid"})  # CLIP weights, sigmoid loss: SigLIP's bias
    model = method.build_model(sigmoid, root / "run")
    said = method.load_initial_weights(model, sigmoid)
    assert model.clip.logit_bias.item() == -10.0 and model.clip.logit_scale.item() == 3.0
    count = len(model.clip.state_dict())
    kept = f"initialised {count - 1} of {count} tensors from {files['pt']}"
    assert said == f"{kept} (open_clip weights, strict; new: logit_bias)", said


@pytest.mark.parametrize(
    "pretrained, model, message",
    [
        ("{pt}", "tiny-siglip-wide", r"does not fit open_clip model .*: tensor 'visual\.\S+' is \[32.* there, \[48"),
        ("{partial}", "tiny-clip", "has no tensor 'text_projection' that open_clip model"),
        ("{root}/missing.pt", "tiny-clip", "missing.pt does not exist"),
        ("laion2b_s99z_b1k", "tiny-clip", "open_clip has no pretrained tag 'laion2b_s99z_b1k' for tiny-clip"),
        ("{root}/tiny-clip.json", "tiny-clip", "as open_clip weights: not tensors that load without running code"),
    ],
    ids=["wrong-shape", "missing-tensor", "missing-file", "unknown-tag", "not-weights"],
)
def test_weights_that_do_not_fit_stop_before_training_naming_the_key(weights, pretrained, model, message):
    root, files, _, _ = weights
    wide = {**TINY_SIGLIP, "vision_cfg": {**TINY["vision_cfg"], "width": 48, "head_width": 16}}
    (root / "tiny-siglip-wide.json").write_text(json.dumps(wide))
    cfg = config(root, pretrained.format(root=root, **{k: str(v) for k, v in files.items()}), model=model)
    with pytest.raises(ConfigError, match="config key 'method.pretrained'") as error:
        check_inputs(cfg, get_method("open_clip"))
    assert re.search(message, str(error.value)) and "\n" not in str(error.value), str(error.value)


DEMO = REPO / "configs/open_clip/demo.yaml"


def from_weights(corpora, run_dir):
    """configs/open_clip/demo.yaml at test size, from weights saved by open_clip in `run_dir`'s parent."""
    from test_config_matrix import shrink

    torch.manual_seed(5)
    start = open_clip.create_model(register_model_config(str(REPO / "mmpt/models/bench-vit-tiny.json")))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    torch.save(start.state_dict(), run_dir.parent / "bench-vit-tiny.pt")
    return [*shrink(DEMO, corpora), f"method.pretrained={run_dir.parent / 'bench-vit-tiny.pt'}"]


@scenario("open-clip-pretrained-sigmoid")
def open_clip_pretrained_sigmoid(corpora, run_dir):
    """configs/open_clip/demo.yaml from a state dict file, sigmoid loss round a ring, tiled, pooled over 2 micro-
    batches at ZeRO-3: trained, resumed, exported and loaded back (a matrix cell)."""
    extra = ["method.loss={name: sigmoid, exchange: ring, tile_size: 3}", "train.zero_stage=3", "train.grad_accum=2"]
    return DEMO, [*from_weights(corpora, run_dir), *extra], "matrix"


@pytest.mark.pool("open-clip-pretrained-sigmoid")
def test_a_run_from_open_clip_weights_trains_resumes_and_exports(rank_pool):
    rank_pool.record("open-clip-pretrained-sigmoid")  # the checks run in the pool (pool_runner.run_matrix_cell)
    windows = [r for r in read_metrics(rank_pool.run_dir("open-clip-pretrained-sigmoid")) if "loss/total" in r]
    assert windows[0]["train/logit_bias"] == -10.0  # SigLIP's initial bias: the weights file had none
    assert windows[0]["train/logit_scale"] == pytest.approx(1 / 0.07, rel=1e-2)  # the file's (in bf16, if trained so)


def test_a_tag_brings_its_preprocessing_and_activation_and_an_unreachable_one_is_one_line(weights, monkeypatch):
    """OpenAI's ViT-B-32 weights: QuickGELU and OpenAI's mean and std; SigLIP's: its own mean, std and squash.
    Nothing is fetched: the download is made to fail as it does offline."""
    root, _, _, _ = weights
    method = get_method("open_clip")
    openai = config(root, "openai", model="ViT-B-32")
    assert method._quick_gelu(openai) and method._preprocess(openai)["mean"] == open_clip.OPENAI_DATASET_MEAN
    siglip = config(root, "webli", model="ViT-B-16-SigLIP")
    assert not method._quick_gelu(siglip)
    assert (
        method._preprocess(siglip)["mean"] == (0.5, 0.5, 0.5) and method._preprocess(siglip)["resize_mode"] == "squash"
    )

    def offline(*args, **kwargs):
        raise OSError("We have no connection or you passed local_files_only\nsecond line")

    monkeypatch.setattr(open_clip, "download_pretrained", offline)
    with pytest.raises(ConfigError, match=r"^config key 'method.pretrained': cannot fetch ViT-B-32 openai: We have no"):
        method.check_initial_weights(openai)


LOCKED = {  # scenario: (ZeRO overrides, lock overrides)
    "open-clip-locked-image-zero0": (["train.zero_stage=0"], ["method.lock_image=0"]),
    "open-clip-locked-image-zero1": (["train.zero_stage=1"], ["method.lock_image=0"]),
    "open-clip-locked-image-zero2": (["train.zero_stage=2"], ["method.lock_image=0"]),
    "open-clip-locked-image-zero3": (["train.zero_stage=3"], ["method.lock_image=0"]),
    "open-clip-locked-image-zero3-offload": (
        ["train.zero_stage=3", "train.offload_optimizer=true"],
        ["method.lock_image=0"],
    ),
    "open-clip-partly-locked-zero3": (["train.zero_stage=3"], ["method.lock_image=2", "method.lock_text=0"]),
}


def locked_scenario(name):
    @scenario(name)
    def build(corpora, run_dir):
        stage, lock = LOCKED[name]
        if "partly" in name:  # trained, resumed, exported and loaded back (a matrix cell)
            return DEMO, [*from_weights(corpora, run_dir), *stage, *lock], "matrix"
        overrides = [*stage, *lock, "train.max_steps=2", "data.eval=[]", "train.eval_every=0"]
        return DEMO, [*from_weights(corpora, run_dir), *overrides], "train"


for _name in LOCKED:
    locked_scenario(_name)


def changed_tensors(run_dir):
    """The names (open_clip's) of the tensors training changed, against the weights it started from."""
    from safetensors.torch import load_file

    start = torch.load(run_dir.parent / "bench-vit-tiny.pt", weights_only=True)
    final = {k.removeprefix("clip."): v for k, v in load_file(str(run_dir / "model.safetensors")).items()}
    assert final.keys() == start.keys()
    return {k for k, v in final.items() if not torch.equal(v.reshape(start[k].shape), start[k])}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.pool(n), id=n) for n in LOCKED if "partly" not in n]
)
def test_a_locked_tower_ends_bit_identical(rank_pool, name):
    """open_clip's lock at every ZeRO stage, optimizer offload included (frozen parameters are where DeepSpeed
    has crashed): the image tower's weights as they were loaded, to the bit; the text tower trained."""
    changed = changed_tensors(rank_pool.run_dir(name))
    assert not {k for k in changed if k.startswith("visual.")}, sorted(changed)[:5]
    assert {"token_embedding.weight", "text_projection"} <= changed  # the text tower trained


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.pool(n), id=n)
        for n in ("open-clip-locked-image-zero1", "open-clip-locked-image-zero2")
    ],
)
def test_a_checkpoint_with_a_locked_tower_consolidates_whole(rank_pool, name):
    """ZeRO-1/2 keep no master copy of a locked tower: weights consolidated from the last checkpoint (what
    `mmpt-export --checkpoint` releases) still hold it, equal to the run's own weights."""
    from safetensors.torch import load_file

    from mmpt.commands.export import consolidated_weights
    from mmpt.engine.checkpoint import find_resume

    run_dir = rank_pool.run_dir(name)
    checkpoint = find_resume(run_dir, "auto")
    assert checkpoint is not None
    state = consolidated_weights(run_dir, checkpoint.name)
    final = load_file(str(run_dir / "model.safetensors"))
    assert state.keys() == final.keys()
    assert all(
        torch.equal(state[k].reshape(v.shape), v.float()) for k, v in final.items() if k.startswith("clip.visual.")
    )


@pytest.mark.pool("open-clip-partly-locked-zero3")
def test_all_but_the_last_groups_locked_changes_exactly_those(rank_pool):
    changed = changed_tensors(rank_pool.run_dir("open-clip-partly-locked-zero3"))
    last = {"visual.proj", "visual.ln_post.weight", "visual.ln_post.bias"}  # open_clip's last two groups
    last |= {k for k in changed if k.startswith("visual.transformer.resblocks.5.")}
    assert last <= changed and {k for k in changed if k.startswith("visual.")} == last, sorted(changed)
    assert not {k for k in changed if not k.startswith("visual.") and k != "logit_scale"}, sorted(changed)

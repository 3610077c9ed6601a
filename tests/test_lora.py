"""LoRA adapters (`method.lora`, through peft): only the adapters train, r x (in + out) parameters per adapted
layer; the base weights end as loaded (ZeRO 0, and 2 and 3 on two ranks in the extended tier); a release exported
from a run folds the adapters in (the base architecture, no `lora` key) and gives the adapted model's embeddings
to 1e-5; targets that match no layer, or that an adapter cannot change, stop before training in one line naming
the key."""

import pytest
import torch
from safetensors.torch import load_file
from test_every_method import one_process  # noqa: F401  (the in-process training fixture)
from test_locking import batch, tiny

from conftest import REPO
from mmpt.config import ConfigError
from mmpt.engine.preflight import check_inputs
from mmpt.methods import get_method
from pool import scenario

CONFIG = REPO / "configs/transformers/clip_finetune.yaml"
DEMO_CLIP = REPO / "configs/clip/demo.yaml"
LORA = "method.lora={targets: [q_proj, v_proj], rank: 4, alpha: 8}"


def adapter_size(corpora) -> int:
    """What LORA's adapters hold, counted on the checkpoint with transformers: rank x (in + out) per layer."""
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(corpora["transformers_clip"])
    targets = [m for n, m in reference.named_modules() if n.endswith(("q_proj", "v_proj"))]
    assert len(targets) == 8  # q and v in 2 layers of 2 towers
    return sum(4 * (m.in_features + m.out_features) for m in targets)


def test_only_the_adapters_train_and_count_rank_times_in_plus_out(corpora, tmp_path):
    _, _, model = tiny("transformers", corpora, tmp_path, LORA)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sum(trained.values()) == adapter_size(corpora) and all(".lora_" in n for n in trained), sorted(trained)[:4]


def test_targets_that_match_nothing_stop_before_training(corpora, tmp_path):
    from test_config_matrix import shrink

    from mmpt.config_loader import load_config

    bad = "method.lora={targets: [query_proj]}"
    cfg = load_config(CONFIG, [*shrink(CONFIG, corpora), f"run.output_dir={tmp_path}", bad])
    with pytest.raises(ConfigError, match=r"^config key 'method.lora.targets': \['query_proj'\] match no linear"):
        check_inputs(cfg, get_method("transformers"))


def test_the_out_proj_of_torchs_multihead_attention_is_refused(corpora, tmp_path):
    """peft wraps it, but MultiheadAttention's forward reads the weight itself: the adapter would stay at zero."""
    says = r"^config key 'method.lora.targets': \S+\.attn\.out_proj is the output projection of torch's Multihead"
    with pytest.raises(ConfigError, match=says):
        tiny("open_clip", corpora, tmp_path, "method.lora={targets: [c_fc, out_proj]}")


# Every method that takes `method.lora`, with targets its demo model has.
TARGETS = {"clip": "[query, value]", "open_clip": "[c_fc, c_proj]", "transformers": "[q_proj, v_proj]"}


def test_every_method_with_adapters_is_listed_here():
    from mmpt.methods import list_methods

    takes = [name for name in list_methods() if "lora" in get_method(name).config_class.model_fields]
    assert sorted(takes) == sorted(TARGETS)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_adapters_pass_the_checks_before_a_run_and_only_they_train(name, corpora, tmp_path):
    """The checks before a run build the adapted model on the meta device; then only the adapters train."""
    lora = f"method.lora={{targets: {TARGETS[name]}, rank: 4, alpha: 8}}"
    cfg, method, model = tiny(name, corpora, tmp_path, lora)
    check_inputs(cfg, method)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained), trained[:4]


@pytest.mark.parametrize(("name", "image"), [("open_clip", "visual."), ("transformers", "vision_model.")])
def test_a_locked_towers_adapters_stay_at_their_start(name, image, corpora, tmp_path):
    """Adapters on both towers, the image tower locked: its adapters do not train (their update stays zero, so the
    tower ends as it began); the text tower's do."""
    lora = f"method.lora={{targets: {TARGETS[name]}, rank: 4, alpha: 8}}"
    _, _, model = tiny(name, corpora, tmp_path, lora, "method.lock_image=0")
    adapters = {n: p.requires_grad for n, p in model.named_parameters() if ".lora_" in n}
    assert any(image in n for n in adapters) and any(image not in n for n in adapters), sorted(adapters)[:4]
    assert all(trains == (image not in n) for n, trains in adapters.items()), adapters


def test_a_bias_the_method_adds_trains_only_when_also_train_names_it(corpora, tmp_path):
    """The transformers method's sigmoid loss adds a logit bias beside the transformers model: with adapters it
    stays as initialised, as every other weight does, unless `also_train` names it."""
    lora, sigmoid = f"method.lora={{targets: {TARGETS['transformers']}}}", "method.loss.name=sigmoid"
    _, _, model = tiny("transformers", corpora, tmp_path / "a", lora, sigmoid)
    assert not model.logit_bias.requires_grad
    also = f"method.lora={{targets: {TARGETS['transformers']}, also_train: [logit_bias]}}"
    _, _, model = tiny("transformers", corpora, tmp_path / "b", also, sigmoid)
    assert model.logit_bias.requires_grad


def test_adapters_only_in_locked_towers_stop_before_training(corpora, tmp_path):
    says = r"^config key 'method.lora.targets': every layer \['query', 'value'\] adapts is in a locked tower"
    with pytest.raises(ConfigError, match=says):
        tiny("clip", corpora, tmp_path, f"method.lora={{targets: {TARGETS['clip']}}}", "method.lock_text=0")


def test_also_train_names_parameters_that_train_beside_the_adapters(corpora, tmp_path):
    """The clip method's projection heads and temperature, new on pretrained towers, train with the adapters."""
    heads = "also_train: [image_projection.*, text_projection.*, logit_scale]"
    cfg, method, model = tiny("clip", corpora, tmp_path, f"method.lora={{targets: [query, value], {heads}}}")
    check_inputs(cfg, method)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n}
    assert trained == {"image_projection.weight", "text_projection.weight", "logit_scale"}, trained
    from test_config_matrix import shrink

    from mmpt.config_loader import load_config

    typo = "method.lora={targets: [query], also_train: [proj*]}"
    cfg = load_config(DEMO_CLIP, [*shrink(DEMO_CLIP, corpora), f"run.output_dir={tmp_path / 'typo'}", typo])
    with pytest.raises(ConfigError, match=r"^config key 'method.lora.also_train': 'proj\*' matches no parameter"):
        check_inputs(cfg, get_method("clip"))


def lora_run(corpora, run_dir, *extra):
    from test_config_matrix import shrink

    stage = ["train.precision=fp32", "train.max_steps=2", "data.eval=[]", "train.eval_every=0", "optim.lr=0.05"]
    return [*shrink(CONFIG, corpora), LORA, *stage, f"run.output_dir={run_dir}", *extra]


def base_unchanged_adapters_trained(corpora, run_dir):
    start = load_file(str(corpora["transformers_clip"] / "model.safetensors"))
    final = load_file(str(run_dir / "model.safetensors"))
    base = {k.replace(".base_layer.", ".").removeprefix("hf."): v for k, v in final.items() if ".lora_" not in k}
    assert base.keys() == start.keys()
    assert all(torch.equal(base[k].reshape(start[k].shape), start[k]) for k in start)
    start_b = [k for k in final if ".lora_B." in k]
    assert start_b and all(final[k].abs().sum() > 0 for k in start_b)  # B starts at zero: the adapters trained


def test_a_lora_run_keeps_its_base_and_exports_a_merged_release(corpora, one_process, tmp_path):  # noqa: F811
    from transformers import AutoModel

    import mmpt
    from mmpt.commands.export import main as export
    from mmpt.config_loader import load_config
    from mmpt.engine import train
    from mmpt.methods.image_text import model_images

    run_dir = tmp_path / "run"
    train(load_config(CONFIG, lora_run(corpora, run_dir, "train.zero_stage=0")))
    base_unchanged_adapters_trained(corpora, run_dir)

    assert export(["--run", str(run_dir), "--out", str(tmp_path / "release")]) == 0
    merged = mmpt.load(tmp_path / "release")
    assert merged.config.method.lora is None  # the base architecture
    size, total = adapter_size(corpora), sum(p.numel() for p in merged.model.parameters())
    card = (tmp_path / "release/README.md").read_text()
    assert f"| parameters | {total:,} ({size:,} trained; {size:,} of them in LoRA adapters, merged into" in card
    assert not [k for k in merged.model.state_dict() if "lora" in k or "base_layer" in k]
    adapted = mmpt.load(run_dir)
    inputs = batch(get_method("transformers"), adapted.config, run_dir)
    with torch.no_grad():
        for model in (adapted, merged):
            model.eval()
        pixels = model_images(merged.model, inputs["image"])
        images = [m.encode_image(pixels) for m in (adapted, merged)]
        texts = [m.encode_text(inputs["input_ids"], inputs["attention_mask"]) for m in (adapted, merged)]
    torch.testing.assert_close(images[0], images[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(texts[0], texts[1], atol=1e-5, rtol=0)
    with torch.no_grad():  # and the adapters made a difference: the checkpoint's own embeddings are others
        base = AutoModel.from_pretrained(corpora["transformers_clip"]).get_image_features(pixel_values=pixels)
    assert (images[0] - torch.nn.functional.normalize(base.pooler_output, dim=-1)).abs().max() > 1e-3


for _stage in (2, 3):

    @scenario(f"transformers-lora-zero{_stage}")
    def lora_scenario(corpora, run_dir, stage=_stage):
        """LoRA adapters on a tiny CLIP checkpoint at ZeRO-2 or 3, 2 steps."""
        return CONFIG, lora_run(corpora, run_dir, f"train.zero_stage={stage}"), "train"


@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=pytest.mark.pool(f"transformers-lora-zero{s}")) for s in (2, 3)]
)
def test_at_zero_2_and_3_the_base_weights_are_unchanged(rank_pool, corpora, stage):
    base_unchanged_adapters_trained(corpora, rank_pool.run_dir(f"transformers-lora-zero{stage}"))

"""M²-Encoder: official state-dict layout, checkpoint formats, tokenizer and preprocessing facts."""

import pickle

import pytest
import torch

from conftest import REPO
from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig
from mmpt.models.m2_official import CheckpointMismatch, fit_positions, load_official
from mmpt.models.m2_remote.glm_tokenizer import GLMTokenizer


def official_layout(size: str) -> dict[str, list[int]]:
    """Key, shape and dtype of every entry of the official checkpoint's state dict, as released (tests/data)."""
    rows = (REPO / f"tests/data/m2_encoder_{size}_state_dict.tsv").read_text().splitlines()
    return {key: eval(shape) for key, shape, _ in (row.split("\t") for row in rows)}  # shapes like [768, 3, 16, 16]


def tiny(**overrides) -> M2Encoder:
    torch.manual_seed(0)
    return M2Encoder(M2EncoderConfig(**{**PRESETS["m2-encoder-demo"], "vocab_size": 300, **overrides}))


@pytest.mark.parametrize("preset, size", [("m2-encoder-0.4b", "0.4b"), ("m2-encoder-1b", "1b")])
def test_state_dict_has_the_official_keys_and_shapes(preset, size):
    with torch.device("meta"):
        model = M2Encoder(M2EncoderConfig(**PRESETS[preset]))
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    official = official_layout(size)
    assert list(ours) == list(official)  # same keys, same order
    assert {k: v for k, v in official.items() if v} == {
        k: v for k, v in ours.items() if k not in ("logit_scale", "logit_vl_scale")
    }
    assert ours["logit_scale"] == [1] and official["logit_scale"] == []


def test_official_0_4b_weights_load_strictly_and_embed(tmp_path, glm_sp_model):
    official = {k: torch.randn(shape) * 0.02 for k, shape in official_layout("0.4b").items()}
    official["logit_scale"] = torch.tensor(4.6)  # 0-D, as released
    path = tmp_path / "m2_0.4b.ckpt"
    torch.save({"state_dict": official, "epoch": 3}, path)  # Lightning layout
    del official
    model = load_official(M2Encoder(M2EncoderConfig(**PRESETS["m2-encoder-0.4b"])), path).eval()
    assert model.logit_scale.shape == (1,) and model.logit_scale.item() == pytest.approx(4.6)
    tokens = GLMTokenizer(glm_sp_model)(["a photo of a cat", "一只猫的照片"])
    with torch.no_grad():
        images = model.encode_image(torch.rand(2, 3, 224, 224) * 2 - 1)
        texts = model.encode_text(tokens["input_ids"], tokens["attention_mask"])
    for features in (images, texts):
        assert features.shape == (2, 768)
        torch.testing.assert_close(features.norm(dim=-1), torch.ones(2))


def test_checkpoint_formats_and_prefixes(tmp_path):
    model = tiny()
    state = model.state_dict()
    official = {
        **{k: v.clone() for k, v in state.items()},
        "logit_scale": torch.tensor(3.0),
        "visual_tokenizer.encoder.weight": torch.zeros(2),
    }  # training-only key, dropped
    layouts = {
        "lightning": {"state_dict": official},
        "deepspeed": {"module": {f"_forward_module.{k}": v for k, v in official.items()}},
        "model": {"model": official},
        "raw": {f"_forward_module.{k}": v for k, v in official.items()},
    }
    for name, layout in layouts.items():
        torch.save(layout, tmp_path / f"{name}.ckpt")
        loaded = load_official(tiny(), tmp_path / f"{name}.ckpt")
        torch.testing.assert_close(loaded.backbone.text_embed.weight, state["backbone.text_embed.weight"])
        assert loaded.logit_scale.item() == 3.0


def test_mismatch_lists_missing_unexpected_and_shapes(tmp_path):
    state = tiny().state_dict()
    del state["pooler.dense.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["itc_vl_text_proj.fc.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointMismatch) as info:
        load_official(tiny(), tmp_path / "bad.ckpt")
    message = str(info.value)
    assert "missing (1): pooler.dense.bias" in message and "unexpected (1): extra.weight" in message
    assert "itc_vl_text_proj.fc.weight: checkpoint [3, 3] vs model [64, 64]" in message


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as handle:
        pickle.dump({"state_dict": {"x": Payload()}}, handle)
    with pytest.raises(CheckpointMismatch, match="refusing to load"):
        load_official(tiny(), path)


def test_vision_positions_fit_the_patch_grid():
    table = torch.arange(3 + 16, dtype=torch.float32)[:, None].repeat(1, 2)  # 4x4 grid
    fitted = fit_positions(table, num_patches=4)  # -> 2x2, area-averaged
    torch.testing.assert_close(fitted[:3], table[:3])
    assert fitted[3:, 0].tolist() == [
        (3 + 4 + 7 + 8) / 4,
        (5 + 6 + 9 + 10) / 4,
        (11 + 12 + 15 + 16) / 4,
        (13 + 14 + 17 + 18) / 4,
    ]
    assert fit_positions(table, 16) is table and fit_positions(table, 36).shape == (3 + 36, 2)


def test_text_features_ignore_padding_and_batch_composition():
    model = tiny().eval()
    ids = torch.randint(5, 300, (3, 24))
    mask = torch.zeros(3, 24, dtype=torch.long)
    for row, length in enumerate((6, 24, 11)):
        mask[row, :length] = 1
    other = ids.clone()
    other[mask == 0] = 7  # different pad ids
    with torch.no_grad():
        a, b = model.encode_text(ids, mask), model.encode_text(other, mask)
        single = model.encode_text(ids[:1], mask[:1])
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(a[:1], single, atol=1e-6, rtol=0)


def test_gradient_checkpointing_gives_the_same_gradients():
    images, ids, mask = torch.randn(2, 3, 32, 32), torch.randint(5, 300, (2, 24)), torch.ones(2, 24, dtype=torch.long)
    grads = []
    for checkpointing in (False, True):
        model = tiny(grad_checkpointing=checkpointing).train()
        image, text, scale = model(images, ids, mask)
        (scale * image @ text.T).sum().backward()
        grads.append(model.backbone.vision_embed.proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def m2_config(**method):
    from mmpt.config_loader import validate_config

    return validate_config(
        {
            "method": {"name": "m2_encoder", "model": "m2-encoder-demo", "arch": {"vocab_size": 300}, **method},
            "run": {"output_dir": "unused"},
            "data": {"train": {"sources": [{"shards": "x.tar"}], "batch_size": 2}},
            "optim": {"lr": 1e-3},
            "train": {"max_steps": 1, "grad_clip": 0.0},
        }
    )


def test_init_from_takes_an_official_folder_a_ckpt_or_a_finished_run_and_brings_its_tokenizer(tmp_path, glm_sp_model):
    import shutil

    from safetensors.torch import save_file

    from mmpt.methods import get_method

    method, source = get_method("m2_encoder"), tiny()
    official = tmp_path / "M2-Encoder"  # an official download: the .ckpt and the GLM sp.model in its folder
    official.mkdir()
    torch.save({"state_dict": source.state_dict()}, official / "m2_encoder_demo.ckpt")
    shutil.copyfile(glm_sp_model, official / "sp.model")
    run = tmp_path / "finished_run"  # a finished run: model.safetensors and the run's own tokenizer
    run.mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(run / "model.safetensors"))
    shutil.copyfile(glm_sp_model, run / "sp.model")
    for init, kind, weights, tokenizer in [
        (official, "official-m2", official / "m2_encoder_demo.ckpt", official / "sp.model"),
        (official / "m2_encoder_demo.ckpt", "official-m2", official / "m2_encoder_demo.ckpt", official / "sp.model"),
        (run, "mmpt", run, run / "sp.model"),
    ]:
        cfg = m2_config(init_from=str(init), tokenizer=None)
        method.resolve_defaults(cfg)
        assert cfg.method.tokenizer == str(tokenizer)
        model = tiny(vocab_size=300)
        torch.nn.init.zeros_(model.backbone.text_embed.weight)
        said = method.load_initial_weights(model, cfg)
        count = len(source.state_dict())
        assert said == f"initialised {count} of {count} tensors from {weights} ({kind}, strict)"
        for key, value in source.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="set method.tokenizer .* or method.init_from"):
        m2_config(tokenizer=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .ckpt .* and no model.safetensors"):
        method.resolve_defaults(m2_config(init_from=str(tmp_path / "empty"), tokenizer=None))

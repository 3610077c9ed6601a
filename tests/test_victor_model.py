"""VICTOR's model and training step on one process: precomputed-feature and frame inputs, task switches,
frozen and preloaded backbones, and config checks."""

import pytest
import timm
import torch
from safetensors.torch import save_file

from mmpt.config import ConfigError
from mmpt.methods import get_method
from mmpt.release import model_config

TASKS = ("mlm", "msom", "mfom", "intra_mfm", "inter_mfm", "dual_vsa")


def section(tokenizer, **video):
    return {
        "name": "victor",
        "tokenizer": str(tokenizer),
        "embed_dim": 16,
        "cross_layers": 1,
        "queue_size": 32,
        "frame_queue_size": 64,
        "video": {"num_frames": 6, "width": 32, "layers": 1, "heads": 2, **video},
        "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16},
    }


def built(tmp_path, method_section):
    cfg = model_config(method_section)
    method = get_method("victor")
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    method.prepare(cfg, run)
    torch.manual_seed(0)
    model = method.build_model(cfg, run)
    method.load_initial_weights(model, cfg)
    return method, model, method.build_loss(cfg), method.tokenizer(cfg, run)


def feature_batch(tokenizer, rows=4, steps=6, dim=20):
    tokens = tokenizer(
        [
            "the digit seven moves to the left.",
            "数字三向上移动。",
            "first a one appears, then a two.",
            "the digit five moves down.",
        ][:rows]
    )
    return {"frame_features": torch.randn(rows, steps, dim), **tokens}


def test_feature_model_trains_every_task_and_fills_the_queues(tmp_path, moving_digits_root):
    method, model, loss, tokenizer = built(
        tmp_path, section(moving_digits_root / "tokenizer.json", backbone=None, feature_dim=20)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        terms = method.training_step(model.train(), loss, feature_batch(tokenizer))
        assert set(terms) == set(TASKS)
        sum(terms.values()).backward()
        trained = [n for n, p in model.named_parameters() if p.grad is not None]
        assert all(not n.startswith("key.") for n in trained)
        untouched = [n for n, p in model.named_parameters() if p.grad is None]
        assert untouched == [], untouched  # every parameter takes part when every task is on
        optimizer.step()
        optimizer.zero_grad()
        model.key.update()
    queues = loss.state_dict()  # what a checkpoint holds: every pushed key written
    assert int(queues["video_queue.count"]) == int(queues["text_queue.count"]) == 12
    assert int(queues["frame_queue.count"]) == 64  # 3 steps x 4 clips x 6 frames pushed, capped at the 64 entries
    assert terms["dual_vsa"].item() > 0 and terms["inter_mfm"].item() > 0
    with torch.no_grad():
        video = model.eval().encode_video(torch.randn(2, 6, 20))
    torch.testing.assert_close(video.norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize("off", ["dual_vsa", "mlm", "mfom"])
def test_a_task_turned_off_is_skipped_and_builds_no_head(tmp_path, moving_digits_root, off):
    method_section = section(moving_digits_root / "tokenizer.json", backbone=None, feature_dim=20)
    method_section["tasks"] = {off: 0.0}
    method, model, loss, tokenizer = built(tmp_path, method_section)
    terms = method.training_step(model.train(), loss, feature_batch(tokenizer))
    assert set(terms) == set(TASKS) - {off}
    sum(terms.values()).backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    # without dual-VSA nothing trains the pooled projections (kept for encode_video / encode_text) or the temperature
    alignment = [
        "unimodal.video_projection.linear.weight",
        "unimodal.text_projection.linear.weight",
        "vsa_scale.log_scale",
    ]
    assert unused == (alignment if off == "dual_vsa" else []), unused
    heads = {"mlm": "mlm_head", "mfom": "frame_order_head"}
    if off in heads:
        assert getattr(model, heads[off]) is None
    if off == "dual_vsa":
        queues = loss.state_dict()
        assert int(queues["video_queue.count"]) == 0 and int(queues["frame_queue.count"]) == 24


def test_frames_model_with_a_frozen_preloaded_backbone(tmp_path, moving_digits_root):
    reference = timm.create_model("resnet10t", pretrained=False, num_classes=10)
    weights = tmp_path / "resnet10t.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(weights))  # classifier included
    method_section = section(
        moving_digits_root / "tokenizer.json",
        backbone="resnet10t",
        image_size=32,
        backbone_weights=str(weights),
        frozen=True,
    )
    method, model, loss, tokenizer = built(tmp_path, method_section)
    backbone = model.unimodal.frame_encoder.backbone
    for name, value in backbone.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
    key_backbone = model.key.network.frame_encoder.backbone.state_dict()
    assert all(torch.equal(key_backbone[n], v) for n, v in backbone.state_dict().items())  # key starts equal
    model.train()
    assert not backbone.training and not any(p.requires_grad for p in backbone.parameters())
    statistics_name = next(k for k in backbone.state_dict() if k.endswith("running_mean"))
    statistics = backbone.state_dict()[statistics_name].clone()
    batch = {"frames": torch.randn(2, 6, 3, 32, 32), **tokenizer(["a", "b"])}
    terms = method.training_step(model, loss, batch)
    sum(terms.values()).backward()
    assert torch.equal(statistics, backbone.state_dict()[statistics_name])  # frozen: BatchNorm statistics untouched
    assert all(p.grad is None for p in backbone.parameters())


def test_bad_video_configs_fail_with_the_key(moving_digits_root):
    tokenizer = moving_digits_root / "tokenizer.json"
    with pytest.raises(ConfigError, match="video.backbone"):
        model_config(section(tokenizer, backbone="resnet10t", feature_dim=20))
    with pytest.raises(ConfigError, match="backbone_weights"):
        model_config(section(tokenizer, backbone=None, feature_dim=20, backbone_weights="w.safetensors"))
    with pytest.raises(ConfigError, match="num_frames"):
        model_config(section(tokenizer, num_frames=2))


def test_frame_order_is_learned_when_the_frames_show_their_time(tmp_path, moving_digits_root):
    """MFOM end to end (shuffle, temporal and cross-modal transformers, 6-way head) on features that are
    one-hot in their time step: the permutation is visible, so the loss must fall far below log 6."""
    method_section = section(moving_digits_root / "tokenizer.json", backbone=None, feature_dim=6)
    method_section["tasks"] = {"mlm": 0, "msom": 0, "dual_vsa": 0, "intra_mfm": 0, "inter_mfm": 0}
    method, model, loss, tokenizer = built(tmp_path, method_section)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = tokenizer(["the digit one moves to the left."] * 16)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(300):
        features = torch.eye(6).repeat(16, 1, 1) + 0.1 * torch.randn(16, 6, 6, generator=generator)
        terms = method.training_step(model.train(), loss, {"frame_features": features, **tokens})
        terms["mfom"].backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(terms["mfom"].item())
    assert sum(losses[:20]) / 20 > 1.6 and sum(losses[-20:]) / 20 < 0.5, (losses[:5], losses[-5:])

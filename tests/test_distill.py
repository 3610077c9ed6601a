"""Distillation from a frozen teacher (`method.distill`, `mmpt.methods.teacher`, `mmpt.losses.distill`).

- The term equals open_clip's `DistillClipLoss` on the whole global batch (temperature 1) and a float64
  computation of the softened cross-entropy (other temperatures), with its gradients, on 1 and 2 gloo ranks.
- A clip student distilled from a transformers CLIP teacher with another tokenizer: the teacher reads the same
  captions through its own tokenizer and the same pixels at its own size; its parameters receive no gradient and
  stay as they were; the run's weights hold the student only.
- Bad teachers end in one line naming the key.
"""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from open_clip.loss import DistillClipLoss
from test_config_matrix import shrink
from test_every_method import demo_config, one_process  # noqa: F401  (a fixture)

from conftest import REPO, read_metrics, run_on_gloo_ranks
from mmpt.config import ConfigError
from mmpt.losses.distill import distillation_loss
from pool import scenario

ROWS, DIM = 3, 6


def global_features(world: int):
    generator = torch.Generator().manual_seed(world)
    draw = [torch.randn(world * ROWS, DIM, generator=generator) for _ in range(4)]
    draw = [torch.nn.functional.normalize(features, dim=-1) for features in draw]
    return draw, torch.tensor(9.0), torch.tensor(14.0)  # student images, texts, teacher's; the two scales


def softened(teacher_logits, student_logits, temperature):
    targets = torch.softmax(teacher_logits / temperature, dim=1)
    return -(targets * torch.log_softmax(student_logits / temperature, dim=1)).sum(1).mean() * temperature**2


def reference(world: int, temperature: float):
    """The whole batch's term and its gradients in float64: open_clip's own at temperature 1, else the formula."""
    (images, texts, t_images, t_texts), scale, t_scale = global_features(world)
    x, y = images.double().requires_grad_(), texts.double().requires_grad_()
    s = scale.double().requires_grad_()
    tx, ty, ts = t_images.double(), t_texts.double(), t_scale.double()
    if temperature == 1.0:
        _, value = DistillClipLoss()(x, y, s, tx, ty, ts)
    else:
        value = 0.5 * (
            softened(ts * tx @ ty.T, s * x @ y.T, temperature) + softened(ts * ty @ tx.T, s * y @ x.T, temperature)
        )
    value.backward()
    return value.item(), x.grad, y.grad, s.grad


def check(rank: int, world: int, temperature: float) -> None:
    (images, texts, t_images, t_texts), scale, t_scale = global_features(world)
    value, grad_x, grad_y, grad_s = reference(world, temperature)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    x, y = images[mine].clone().requires_grad_(), texts[mine].clone().requires_grad_()
    s = scale.clone().requires_grad_()
    loss = distillation_loss(x, y, s, t_images[mine], t_texts[mine], t_scale, temperature)
    loss.backward()
    assert x.grad is not None and y.grad is not None and s.grad is not None
    total, scale_grad = loss.detach().clone(), s.grad.clone()
    if world > 1:  # the engine averages over ranks, as DDP does
        dist.all_reduce(total)
        dist.all_reduce(scale_grad)
    assert float(total) / world == pytest.approx(value, rel=1e-6)
    torch.testing.assert_close(x.grad.double() / world, grad_x[mine], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(y.grad.double() / world, grad_y[mine], rtol=1e-5, atol=1e-7)
    assert float(scale_grad) / world == pytest.approx(float(grad_s), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_one_rank_equals_open_clips_term(temperature):
    check(0, 1, temperature)


def test_two_ranks_equal_the_whole_batchs_term():
    run_on_gloo_ranks(__name__, [("check", (2, t)) for t in (1.0, 2.5)], 2)


def teacher_section(kind, corpora, tmp_path) -> str:
    """A transformers CLIP folder, or open_clip weights saved to a file (both with CLIP's BPE tokenizer, not the
    student's WordPiece)."""
    if kind == "transformers":
        return f"{{name: transformers, model: {corpora['transformers_clip']}}}"
    import open_clip

    from mmpt.models.open_clip_model import register_model_config

    model = REPO / "mmpt/models/bench-vit-tiny.json"
    torch.save(open_clip.create_model(register_model_config(str(model))).state_dict(), tmp_path / "teacher.pt")
    return f"{{name: open_clip, model: {model}, pretrained: {tmp_path / 'teacher.pt'}}}"


def distilled(corpora, tmp_path, *extra, kind="transformers"):
    """A tiny clip student and its teacher."""
    from test_locking import tiny

    teacher = f"method.distill={{teacher: {teacher_section(kind, corpora, tmp_path)}}}"
    cfg, method, model = tiny("clip", corpora, tmp_path, teacher, *extra)
    recipe = method.teacher(cfg)
    assert recipe is not None
    built = recipe.build()
    recipe.load(built)
    return cfg, method, model, recipe, recipe.around(method.build_loss(cfg), built)


@pytest.mark.parametrize("kind", ["transformers", "open_clip"])
def test_the_teacher_reads_its_own_tokens_and_pixels_and_stays_frozen(corpora, tmp_path, kind):
    extra = ("method.distill.weight=0.5", "method.image.image_size=40")
    cfg, method, model, recipe, loss = distilled(corpora, tmp_path, *extra, kind=kind)
    start = {k: v.clone() for k, v in loss.teacher.state_dict().items()}
    stream = method.train_data(cfg, tmp_path, rank=0, world_size=1)
    batch = next(iter(stream)).batch
    captions = stream_captions(stream)
    theirs = recipe.tokenizer()(captions)
    assert torch.equal(batch["teacher_input_ids"], theirs["input_ids"])  # the teacher's tokenizer on the same text
    assert not torch.equal(batch["teacher_input_ids"][:, :4], batch["input_ids"][:, :4])
    assert recipe.image_size() != tuple(batch["image"].shape[-2:])  # resized on the way in
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss.train()
    assert not loss.teacher.training
    terms = method.training_step(model, loss, batch)
    assert set(terms) == {"contrastive", "distill", "train"} and terms["distill"].item() > 0
    sum(v for k, v in terms.items() if k != "train").backward()
    optimizer.step()
    assert all(p.grad is None and not p.requires_grad for p in loss.teacher.parameters())
    assert all(torch.equal(v, start[k]) for k, v in loss.teacher.state_dict().items())
    alone = loss.loss(*model(model_images(model, batch), batch["input_ids"], batch["attention_mask"]))
    with torch.no_grad():  # the term is weighted: twice the weight, twice the term
        pooled = loss(*model(model_images(model, batch), batch["input_ids"], batch["attention_mask"]), batch, 2)
        once = loss(*model(model_images(model, batch), batch["input_ids"], batch["attention_mask"]), batch)
    assert pooled.item() == pytest.approx(once.item() / 2) and torch.isfinite(alone)


def test_a_merged_pool_pass_distils_as_the_separate_one(corpora, tmp_path):
    """A distilled student's pooled step over 2 micro-batches, run as one merged pass (`merged_step`) and as the
    pool pass plus 2 training steps: the same contrastive and distillation terms and the same gradients."""
    from mmpt.engine.run import TrainingModule

    cfg, method, model, _, loss = distilled(corpora, tmp_path)
    module = TrainingModule(method, model, loss, method.engine_needs(model, cfg)).train()
    stream = iter(method.train_data(cfg, tmp_path, rank=0, world_size=1))
    batches = [next(stream).batch for _ in range(2)]

    def gradients():
        found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return found

    separate = {"contrastive": 0.0, "distill": 0.0}
    with torch.no_grad():
        pool = module(batches, entry="pool")
    for index, batch in enumerate(batches):
        terms = module(batch, pool, index)
        (terms["contrastive"] + terms["distill"]).backward()
        separate["contrastive"] += terms["contrastive"].item() / len(batches)  # each is the whole step's loss
        separate["distill"] += terms["distill"].item()  # each micro-batch's own term, weighted 1/K
    expected = gradients()
    terms = module(batches, entry="merged")
    (terms["contrastive"] + terms["distill"]).backward()
    merged = gradients()
    assert {name: terms[name].item() for name in separate} == pytest.approx(separate, rel=1e-6)
    whole = torch.cat([g.flatten() for g in expected.values()]).norm()
    assert merged.keys() == expected.keys()
    for name, grad in expected.items():
        assert (merged[name] - grad).norm() <= 1e-6 * whole, name


def model_images(model, batch):
    from mmpt.methods.image_text import model_images

    return model_images(model, batch["image"])


def stream_captions(stream):
    """The captions of the stream's first batch, read again through a decoder that keeps the text."""
    decoder = stream.decode
    captured: list[str] = []
    tokenize = decoder.tokenize

    def keep(texts):
        captured.extend(texts)
        return tokenize(texts)

    decoder.tokenize = keep
    try:
        next(iter(stream))
    finally:
        decoder.tokenize = tokenize
    return captured


def test_a_distilled_run_trains_and_keeps_the_student_alone(corpora, one_process, tmp_path, caplog):  # noqa: F811
    from safetensors.torch import load_file
    from transformers import CLIPModel

    from mmpt.commands.export import main as export
    from mmpt.config_loader import load_config
    from mmpt.engine import train

    config = demo_config("clip")
    run_dir = tmp_path / "run"
    clip = corpora["transformers_clip"]
    teacher = f"method.distill={{teacher: {{name: transformers, model: {clip}}}, temperature: 2}}"
    overrides = [*shrink(config, corpora), f"run.output_dir={run_dir}", "train.zero_stage=0", "train.precision=fp32"]
    with caplog.at_level(logging.INFO, logger="mmpt"):
        train(load_config(config, [*overrides, teacher, "train.max_steps=2", "data.eval=[]", "train.eval_every=0"]))
    said = f"distillation: teacher transformers {clip}, weight 1, temperature 2"
    assert "teacher: initialised" in caplog.text and said in caplog.text and "loss: contrastive" in caplog.text
    assert export(["--run", str(run_dir), "--out", str(tmp_path / "release")]) == 0
    assert f"- {said}" in (tmp_path / "release/README.md").read_text()  # the model card says so too
    logged = (run_dir / "metrics.jsonl").read_text()
    assert '"loss/distill"' in logged
    weights = load_file(str(run_dir / "model.safetensors"))
    assert not [k for k in weights if "teacher" in k or k.startswith("hf.")]
    saved = torch.load(next((run_dir / "checkpoints").glob("*/mp_rank_00_model_states.pt")), weights_only=False)
    kept = {k.removeprefix("loss.teacher.hf."): v for k, v in saved["module"].items() if k.startswith("loss.teacher.")}
    original = CLIPModel.from_pretrained(corpora["transformers_clip"]).state_dict()
    differ = [k for k, v in kept.items() if not torch.equal(v.reshape(original[k].shape), original[k])]
    assert kept and not differ, differ
    assert (run_dir / "teacher" / "transformers" / "tokenizer.json").is_file()


def test_bad_teachers_end_in_one_line_naming_the_key(corpora, tmp_path):
    """Not an image-text model, not a directory, weights that do not fit the teacher's own config: each found
    before training (`check_teacher` runs in the launcher's preflight: exit 2)."""
    from safetensors.torch import save_file
    from test_locking import tiny

    from mmpt.config import save_config
    from mmpt.config_loader import load_config
    from mmpt.methods.teacher import check_teacher

    base, _, model = tiny("clip", corpora, tmp_path)
    release = tmp_path / "release"  # a run directory whose weights are of another embedding size
    release.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(release / "model.safetensors"))
    other = base.model_copy(update={"method": base.method.model_copy(update={"embed_dim": 32})})
    save_config(other, release / "config.yaml")
    shutil.copy(tmp_path / "tokenizer.json", release)
    transformers_folder = tmp_path / "hf"  # what save_pretrained writes: another library's config.json
    transformers_folder.mkdir()
    (transformers_folder / "config.json").write_text('{"model_type": "clip"}')
    bad = {
        str(transformers_folder): r"config.json is not an mmpt release .*\{name: transformers, model: .*/hf\}$",
        "{name: space2}": "method 'space2' is not an image-text model",
        str(tmp_path / "nowhere"): f"{tmp_path / 'nowhere'} is not a directory",
        "{name: transformers, model: /nowhere/clip}": r"^config key 'method.distill.teacher.model': /nowhere/clip does",
        str(release): f"{release / 'model.safetensors'} does not fit its 'clip' config: shape mismatch",
    }
    config = demo_config("clip")
    for teacher, said in bad.items():
        distill = f"method.distill={{teacher: {teacher}}}"
        cfg = load_config(config, [*shrink(config, corpora), f"run.output_dir={tmp_path / 'run'}", distill])
        with pytest.raises(ConfigError) as caught:
            check_teacher(cfg)
        message = str(caught.value)
        assert message.startswith("config key 'method.distill.teacher") and "\n" not in message, message
        assert re.search(said, message), message
    # A run keeps its own tokenizer: the path its config named may be gone (a relative one, seen from elsewhere).
    good = tmp_path / "good"
    shutil.copytree(release, good)
    moved = base.method.model_copy(update={"tokenizer": "demo_data/gone/tokenizer.json"})
    save_config(base.model_copy(update={"method": moved}), good / "config.yaml")
    cfg = load_config(
        config, [*shrink(config, corpora), f"run.output_dir={tmp_path / 'run'}", f"method.distill.teacher={good}"]
    )
    check_teacher(cfg)


@scenario("clip-distill-zero3-pooled")
def clip_distill_zero3_pooled(corpora, run_dir):
    """The clip demo distilled at ZeRO-3 on 2 ranks (the teacher partitioned like the student) with pooled
    accumulation over 2 micro-batches, in bf16."""
    config = demo_config("clip")
    teacher = f"method.distill={{teacher: {{name: transformers, model: {corpora['transformers_clip']}}}}}"
    rest = ["train.zero_stage=3", "train.grad_accum=2", "train.precision=bf16", "train.max_steps=2"]
    return config, [*shrink(config, corpora), teacher, *rest, "data.eval=[]", "train.eval_every=0"], "train"


@pytest.mark.pool("clip-distill-zero3-pooled")
def test_a_zero3_run_distils_with_pooled_accumulation(rank_pool):
    from safetensors.torch import load_file

    run_dir = rank_pool.run_dir("clip-distill-zero3-pooled")
    distilled = [r["loss/distill"] for r in read_metrics(run_dir) if "loss/distill" in r]
    assert len(distilled) == 2 and all(0 < v < 100 for v in distilled), distilled
    assert not [k for k in load_file(str(run_dir / "model.safetensors")) if "teacher" in k or k.startswith("hf.")]


def check_no_rank_holds_the_teacher_whole(rank: int, tmp: str, digits: str) -> None:
    """A clip student's teacher, an M²-Encoder release, built under ZeRO-3 on 2 ranks: no rank's peak resident
    memory grows by 0.8x the teacher's fp32 bytes while it is built and loaded (read tensor by tensor), and each
    rank ends with its partition of every teacher parameter, whose whole values are the release's."""
    from pathlib import Path

    from safetensors.torch import load_file
    from test_sharded_build import ARCH, WORLD, _config, _deepspeed_ready, _peak_growth, _start

    from mmpt import distributed as mdist
    from mmpt.engine.checkpoint.weights import write_weights
    from mmpt.engine.run import loss_with_teacher, seed_everything
    from mmpt.methods import get_method

    _start(rank)
    release = Path(tmp) / "teacher"
    # the ~310 MB M²-Encoder of the partitioned-build memory test, no tensor above 5% of it
    settings = {"name": "m2_encoder", "model": "m2-encoder-demo", "arch": ARCH, "tokenizer": "unused.json"}
    if rank == 0:
        seed_everything(7)
        release.mkdir()
        built = get_method("m2_encoder").build_model(_config(settings, tmp), release)
        write_weights(built, release / "model.safetensors")
        del built
    dist.barrier()
    teacher = {**settings, "init_from": str(release)}
    student = {"name": "clip", "tokenizer": f"{digits}/tokenizer.json", "distill": {"teacher": teacher}}
    cfg = _config(student, f"{tmp}/run")
    expected = load_file(str(release / "model.safetensors"))
    whole_bytes = sum(t.numel() * 4 for t in expected.values())
    _deepspeed_ready()
    loss, grown = _peak_growth(lambda: loss_with_teacher(cfg, get_method("clip"), WORLD, False))
    growth = mdist.all_gather_objects(grown)
    assert all(g < 0.8 * whole_bytes for g in growth), f"built the teacher with {growth} of {whole_bytes} bytes"
    held = sum(p.ds_tensor.numel() for p in loss.teacher.parameters())
    assert held < 0.6 * sum(p.ds_numel for p in loss.teacher.parameters())  # its half, padded
    import deepspeed

    for name, param in loss.teacher.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            assert torch.equal(param.data, expected[name]), name
    mdist.barrier()


def test_at_zero3_no_rank_holds_the_teacher_whole(tmp_path, digits_root):
    run_on_gloo_ranks(__name__, [("check_no_rank_holds_the_teacher_whole", (str(tmp_path), str(digits_root)))], 2)


def test_the_planner_counts_the_teacher_as_frozen_parameters(corpora, tmp_path):
    from transformers import CLIPModel

    from mmpt.config_loader import load_config
    from mmpt.plan.build import built, count

    config = demo_config("clip")
    base = load_config(config, [*shrink(config, corpora), f"run.output_dir={tmp_path}"])
    teacher = f"method.distill={{teacher: {teacher_section('transformers', corpora, tmp_path)}}}"
    distilled = load_config(config, [*shrink(config, corpora), f"run.output_dir={tmp_path}", teacher])
    with built(base) as plain, built(distilled) as taught:
        alone, beside = count(plain), count(taught)
    size = sum(p.numel() for p in CLIPModel.from_pretrained(corpora["transformers_clip"]).parameters())
    assert beside.frozen - alone.frozen == size and beside.trainable == alone.trainable

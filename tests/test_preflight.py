"""Every file a config names is checked before the process group starts: exit 2 and one line naming the
key and the path; the command-line tools end in one line too, never a traceback.

The commands run in this process (`command_in_process`); tests/test_config.py starts `launch/train.py` and
the launcher for real."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, command_in_process, launcher_env, tiny_config, write_config
from mmpt.engine.stops import EXIT_CONFIG


@pytest.fixture
def command(capfd, monkeypatch):
    """`command(name, *argv)` -> (exit code, stderr): `command_in_process`, where starting a process group fails
    the test: every error checked with it must come before one."""
    from mmpt.engine import run

    def no_process_group(*args):
        raise AssertionError("a process group was started before the error was found")

    monkeypatch.setattr(run, "start_process_group", no_process_group)

    def call(name: str, *argv: str) -> tuple[int, str]:
        done = command_in_process(capfd, name, *argv)
        return done.returncode, done.stderr

    return call


def train(command, config, *overrides):
    return command("train", "--config", str(config), *overrides)


@pytest.mark.parametrize(
    "override, key",
    [
        ("method.tokenizer={missing}/tokenizer.json", "method.tokenizer"),
        ("data.train.sources.1.shards={missing}/zh-{{000000..000003}}.tar", "data.train.sources.1.shards"),
        ("data.eval=[{{dataset: {missing}/imagenet, task: zeroshot_classification}}]", "data.eval.0.dataset"),
        (
            "data.eval=[{{dataset: digits, task: zeroshot_classification}}, "
            "{{dataset: {missing}/cn, task: zeroshot_classification}}]",
            "data.eval.1.dataset",
        ),
        ("run.resume={missing}/checkpoints/step_000000100", "run.resume"),
    ],
)
def test_a_missing_input_stops_before_the_process_group(tmp_path, digits_root, command, override, key):
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))
    missing = tmp_path / "not_here"
    code, output = train(command, config, override.format(missing=missing))
    assert code == EXIT_CONFIG, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert len(lines) == 1 and lines[0].startswith(f"mmpt: config error: config key '{key}': "), output[-3000:]
    assert str(missing) in lines[0] and "does not exist" in lines[0]
    assert "Traceback" not in output and not (tmp_path / "run").exists()


def test_too_few_shards_for_epoch_mode_stop_before_the_process_group(tmp_path, digits_root, command, monkeypatch):
    """Epoch mode gives every reader whole shards: 8 shards cannot feed 2 launched ranks x 5 workers."""
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, output = train(command, config, "data.train.mode=epoch", "data.train.num_workers=5")
    assert code == EXIT_CONFIG, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert len(lines) == 1 and lines[0].startswith("mmpt: config error: config key 'data.train.sources.0.shards': ")
    assert "8 shards cannot feed 10 readers (ranks x workers) in epoch mode" in lines[0], lines
    assert "Traceback" not in output and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, says",
    [
        ("data.train.sources.1.caption_key=json.captoin", "has no non-empty caption under json.captoin (it has "),
        ("data.train.sources.1.image_key=jgp", "has no non-empty image under jgp (it has "),
    ],
)
def test_a_field_key_no_sample_holds_stops_before_the_process_group(tmp_path, digits_root, command, override, says):
    """A typo in a field key is one line naming the key and what the samples hold, not a skipped sample a line."""
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))
    code, output = train(command, config, override)
    assert code == EXIT_CONFIG, output[-3000:]
    key = override.split("=")[0]
    said = [line for line in output.splitlines() if "mmpt: " in line or "skipped" in line]
    assert len(said) == 1 and said[0].startswith(f"mmpt: config error: config key '{key}': none of the first "), said
    assert says in said[0] and "Traceback" not in output and not (tmp_path / "run").exists()


def test_an_eval_every_with_nothing_to_evaluate_stops_before_the_process_group(tmp_path, digits_root, command):
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))  # no data.eval
    code, output = train(command, config, "train.eval_every=5")
    assert code == EXIT_CONFIG, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert lines == [
        "mmpt: config error: config key 'train.eval_every' = 5: there is no data.eval set to evaluate "
        "(name one in data.eval, or set train.eval_every=0)"
    ], output[-3000:]
    assert "Traceback" not in output and not (tmp_path / "run").exists()


def test_m2_init_from_a_missing_download_is_named_before_its_tokenizer(tmp_path, digits_root, command):
    cfg = tiny_config(digits_root, tmp_path / "run")
    cfg["method"] = {
        "name": "m2_encoder",
        "model": "m2-encoder-demo",
        "init_from": str(tmp_path / "official"),
        "tokenizer": None,
    }
    code, output = train(command, write_config(tmp_path / "cfg.yaml", cfg))
    assert code == EXIT_CONFIG
    assert f"mmpt: config error: config key 'method.init_from': {tmp_path / 'official'} does not exist" in output


@pytest.mark.parametrize(
    "tool",
    [
        ["zeroshot", "--model", "{run}", "--dataset", "{missing}"],
        ["zeroshot", "--model", "{missing}", "--dataset", "digits"],
        ["export", "--run", "{missing}", "--out", "{out}"],
        ["embed", "--model", "{missing}", "--shards", "{missing}/x.tar", "--modality", "image", "--out", "{out}"],
        ["intent_eval", "--model", "{missing}", "--dataset", "{missing}"],
        ["intent_eval", "--encoder", "{missing}", "--dataset", "dialogs"],
        ["make_video_shards", "--videos", "{run}", "--captions", "{missing}.json", "--out", "{out}"],
        ["make_dialog_shards", "--labelled", "{missing}.json", "--out", "{out}"],
    ],
)
def test_the_command_line_tools_name_a_missing_path_in_one_line(tmp_path, command, tool):
    values = {"run": tmp_path, "missing": tmp_path / "nowhere", "out": tmp_path / "out"}
    name, *args = [part.format(**values) for part in tool]
    code, output = command(name, *args)
    assert code == EXIT_CONFIG, output[-3000:]
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert len(lines) == 1 and "nowhere" in lines[0], output[-3000:]


def launched(config):
    """`python launch/train.py --config config` in a new process, as a user starts it."""
    command = [sys.executable, str(REPO / "launch/train.py"), "--config", str(config)]
    return subprocess.run(command, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300)


def test_a_run_says_what_it_will_do_and_a_finished_run_says_it_is_done(tmp_path, digits_root):
    cfg = tiny_config(digits_root, tmp_path / "run", train={"max_steps": 2, "save_every": 0})
    cfg["data"]["train"]["sources"][1].update(name="zh", caption_key="txt")
    cfg["data"]["eval"] = [
        {"dataset": str(digits_root / "zeroshot"), "task": "zeroshot_classification", "languages": ["en", "zh"]}
    ]
    cfg["train"]["eval_every"] = 2
    config = write_config(tmp_path / "cfg.yaml", cfg)
    first = launched(config)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = first.stderr[first.stderr.index("run summary") :].splitlines()[1:13]
    assert [line.strip().split(":")[0].split(" ")[0] for line in summary] == [
        "ranks",
        "ZeRO",
        "batch",
        "parameters",
        "loss",
        "learning",
        "initial",
        "source",
        "source",
        "checkpoints",
        "evaluation",
        "output",
    ], summary
    assert summary[4].strip() == "loss: contrastive"  # the method's line (Method.summary_lines)
    assert summary[5].strip() == "learning rate 0.001"  # warmup_steps 2 of 2: reached at the last step
    assert summary[10].strip() == "evaluation every 2 steps and at the end: zeroshot (zeroshot_classification, en/zh)"
    assert "16 per rank x 1 micro-batch(es) x 1 data-parallel rank(s) = 16 samples per step, 2 steps" in summary[2]
    assert summary[8].strip().startswith("source 'zh': 8 shard(s), ") and summary[8].endswith("caption_key=txt")
    again = launched(config)
    assert again.returncode == 0
    assert f"mmpt: {tmp_path / 'run'} already finished at step 2 (train.max_steps=2): nothing to do" in again.stdout
    assert "run summary" not in again.stderr and "step 3" not in again.stdout


def test_initial_weights_that_do_not_fit_the_model_are_a_config_error(
    tmp_path, digits_root, capfd, process_group_of_one
):
    """Found while building the model, in the process group (of one, here)."""
    import torch

    (tmp_path / "official").mkdir()
    torch.save({"state_dict": {"backbone.other.weight": torch.zeros(2)}}, tmp_path / "official/m2.ckpt")
    cfg = tiny_config(digits_root, tmp_path / "run")
    cfg["method"] = {
        "name": "m2_encoder",
        "model": "m2-encoder-demo",
        "arch": {"vocab_size": None},
        "tokenizer": str(digits_root / "tokenizer.json"),
        "init_from": str(tmp_path / "official"),
        "loss": {"name": "gba_itc", "group_size": 1},
    }
    done = command_in_process(capfd, "train", "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    code, output = done.returncode, done.stderr
    assert code == EXIT_CONFIG and "Traceback" not in output, output[-3000:]
    assert re.search(
        r"mmpt: config error: .*m2.ckpt does not fit this M2-Encoder config: missing \(\d+\): .*; "
        r"unexpected \(1\): backbone.other.weight",
        output,
    ), output[-2000:]


def test_a_retrieval_set_of_one_tar_shard_is_left_for_the_evaluation_to_read(tmp_path, digits_root):
    """A shard is read whole when evaluated, not as a listing before training (which refuses other files)."""
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    (tmp_path / "heldout.tar").write_bytes(b"")
    sets = f"data.eval=[{{dataset: {tmp_path / 'heldout.tar'}, task: zeroshot_retrieval}}]"
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))
    get_method("clip").check_eval_sets(load_config(config, [sets]))


@pytest.mark.parametrize(
    "config, override, key, says",
    [
        (
            "victor/demo.yaml",
            "data.eval=[{{dataset: {root}/listing.jsonl, task: zeroshot_retrieval}}]",
            "data.eval.0.dataset",
            "listing.jsonl: video {root}/clip00 not found (also tried it with .mp4, .webm, .avi) (set "
            "method.retrieval.video_root to the folder of the clips)",
        ),
        (
            "victor/demo.yaml",
            "data.eval=[{{dataset: {root}/listing.jsonl, task: zeroshot_retrieval, languages: [en, zh]}}]",
            "data.eval.0.languages",
            "data.eval.0.languages ['en', 'zh'] choose the moving_digits demo's caption files",
        ),
        (
            "space2/demo.yaml",
            "data.eval=[{{dataset: {root}/intent, task: intent}}]",
            "data.eval.0.dataset",
            "intent dataset {root}/intent: test.csv is missing",
        ),
        (
            "space2/demo.yaml",
            "data.eval=[{{dataset: dialogs, task: intent, languages: [en, zh]}}]",
            "data.eval.0.languages",
            "data.eval.0.languages ['en', 'zh']: an intent set is evaluated once, in its own language",
        ),
        (
            "space2/demo.yaml",
            "data.eval=[{{dataset: {root}/empty, task: intent}}]",
            "data.eval.0.dataset",
            "has no rows",
        ),
        (
            "clip/demo.yaml",
            "data.eval=[{{dataset: {root}/images.jsonl, task: zeroshot_retrieval}}]",
            "data.eval.0.dataset",
            "images.jsonl: image {root}/cat.jpg does not exist (1 missing)",
        ),
        (
            "clip/demo.yaml",
            "data.eval=[{{dataset: {root}/valid_texts.jsonl, task: zeroshot_retrieval}}]",
            "data.eval.0.dataset",
            "valid_imgs.tsv: its first line is not image_id<TAB>base64 image (",
        ),
        (
            "clip/demo.yaml",
            "data.eval=[{{dataset: {root}/pairs.csv, task: zeroshot_retrieval}}]",
            "data.eval.0.dataset",
            "pairs.csv: not a retrieval layout mmpt reads",
        ),
        (
            "clip/demo.yaml",
            "method.tokenizer={root}/pairs.csv",
            "method.tokenizer",
            "cannot read a tokenizer from {root}/pairs.csv: ",
        ),
        (
            "victor/demo.yaml",
            "method.text.pretrained={root}",
            "method.text.pretrained",
            "the victor method builds its text tower as a new BERT",
        ),
    ],
)
def test_what_training_would_fail_on_or_ignore_stops_before_it_starts(tmp_path, command, config, override, key, says):
    """An evaluation set the end of training would fail to read, or a key the method would not read, is found
    before the process group starts."""
    (tmp_path / "listing.jsonl").write_text('{"video": "clip00", "caption": "a red square moves left"}\n')
    (tmp_path / "images.jsonl").write_text('{"image": "cat.jpg", "caption": ["a cat"]}\n')
    (tmp_path / "pairs.csv").write_text("image,caption\ncat.jpg,a cat\n")
    (tmp_path / "valid_texts.jsonl").write_text('{"text_id": 1, "text": "a cat", "image_ids": [1]}\n')
    (tmp_path / "valid_imgs.tsv").write_text("1\tbm90IGFuIGltYWdl\n")  # base64, but of no image
    for folder, rows in (("intent", "text,category\nhello,greet\n"), ("empty", "text,category\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.csv").write_text(rows)
    (tmp_path / "empty" / "test.csv").write_text("text,category\n")
    code, output = train(
        command, REPO / "configs" / config, f"run.output_dir={tmp_path / 'run'}", override.format(root=tmp_path)
    )
    assert code == EXIT_CONFIG, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert len(lines) == 1 and says.format(root=tmp_path) in lines[0], output[-3000:]
    assert f"'{key}" in lines[0] or key in lines[0], lines[0]


def test_a_library_warning_is_printed_once_and_torchs_renamed_collectives_not_at_all():
    """huggingface_hub prints with a handler of its own (the root logger would print each retry again); torch
    2.14's notice on collectives DeepSpeed calls by their old names is not news to a user; what a library says
    at INFO on the root logger itself (as open_clip does) is not printed, a named logger's INFO is."""
    code = (
        "import logging, warnings, huggingface_hub.utils._http\n"
        "from mmpt.commands.train import configure_output\n"
        "configure_output(0)\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('retrying in 1s')\n"
        "logging.info('Loaded built-in ViT-B-32 model config.')\n"
        "logging.warning('a root warning')\n"
        "logging.getLogger('my_method').info('a method of its own')\n"
        "warnings.warn('`torch.distributed.all_gather_into_tensor` is deprecated. Use another.', FutureWarning)\n"
        "warnings.warn('something else is deprecated', FutureWarning)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launcher_env(), check=True)
    assert done.stderr.count("retrying in 1s") == 1, done.stderr
    assert "all_gather_into_tensor" not in done.stderr and "something else is deprecated" in done.stderr
    assert "model config" not in done.stderr and "a root warning" in done.stderr, done.stderr
    assert "a method of its own" in done.stderr, done.stderr

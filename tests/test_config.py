import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, deepspeed_command, launcher_env, tiny_config, write_config
from mmpt.config import ConfigError, save_config
from mmpt.config_loader import load_config


@pytest.fixture
def config_file(tmp_path, digits_root):
    return write_config(tmp_path / "run.yaml", tiny_config(digits_root, tmp_path / "run"))


def error_of(path, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_demo_config_is_valid():
    cfg = load_config(REPO / "configs/clip/demo.yaml")
    assert cfg.train.zero_stage == 2 and cfg.optim.name == "adamw" and cfg.method.name == "clip"


def test_unknown_key_names_key_file_and_closest(config_file):
    data = yaml.safe_load(config_file.read_text())
    data["train"]["max_step"] = 5
    write_config(config_file, data)
    message = error_of(config_file)
    assert "'train.max_step'" in message and str(config_file) in message and "'train.max_steps'" in message


def test_unknown_method_key_names_closest(config_file):
    message = error_of(config_file, ["method.text.widht=8"])
    assert "'method.text.widht'" in message and "'method.text.width'" in message and "<command line>" in message


def test_wrong_type_and_bad_value(config_file):
    assert "'optim.lr'" in error_of(config_file, ["optim.lr=fast"])
    message = error_of(config_file, ["train.zero_stage=4"])
    assert "'train.zero_stage'" in message and "less than or equal to 3" in message
    assert "'train.precision'" in error_of(config_file, ["train.precision=fp8"])


def test_unknown_method_is_named(config_file):
    message = error_of(config_file, ["method.name=clp"])
    assert "'clp'" in message and "did you mean 'clip'" in message


def test_unknown_demo_corpus_is_named(config_file):
    message = error_of(config_file, ["data.prepare=digit"])
    assert "'data.prepare'" in message and "did you mean 'digits'" in message
    assert "dialogs, digits, moving_digits" in message  # every corpus in mmpt/demo registered itself


def test_error_in_base_file_names_the_base(tmp_path, config_file):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  grad_clipp: 1.0\n")
    data = yaml.safe_load(config_file.read_text())
    data["extends"] = [*data["extends"], str(base)]
    write_config(config_file, data)
    message = error_of(config_file)
    assert str(base) in message and "'train.grad_clip'" in message


def test_extends_merges_and_overrides_win(config_file):
    cfg = load_config(config_file, ["optim.lr=0.25", "data.train.sources.1.weight=3"])
    assert cfg.train.zero_stage == 2  # from configs/base/zero2.yaml
    assert cfg.optim.betas == (0.9, 0.98)  # from configs/base/optim_adamw.yaml
    assert cfg.optim.lr == 0.25 and cfg.data.train.sources[1].weight == 3


def test_extends_names_a_shipped_config_from_anywhere(tmp_path):
    """A user's config outside the repository extends `space2/demo` (or `configs/space2/demo.yaml`), as
    --config names it; a name that is neither a file beside it nor a shipped config is one line listing them."""
    for name in ("space2/demo", "configs/space2/demo.yaml"):
        (tmp_path / "mine.yaml").write_text(f"extends: [{name}]\ntrain: {{max_steps: 3}}\n")
        cfg = load_config(tmp_path / "mine.yaml")
        assert cfg.method_name == "space2" and cfg.train.max_steps == 3
    (tmp_path / "typo.yaml").write_text("extends: [space2/dmeo]\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: 'extends': config file not found: space2/dmeo \(nor a shipped"):
        load_config(tmp_path / "typo.yaml")


def test_resolved_config_round_trips(tmp_path, config_file):
    cfg = load_config(config_file, ["train.max_steps=77"])
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert again == cfg and again.train.max_steps == 77


def test_launcher_rejects_typo_within_seconds(tmp_path, config_file):
    data = yaml.safe_load(config_file.read_text())
    data["optim"]["learning_rate"] = 1.0
    write_config(config_file, data)
    started = time.monotonic()
    result = subprocess.run(
        deepspeed_command(config_file), cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("mmpt: config error:")]
    assert len(lines) == 1, result.stderr
    assert "'optim.learning_rate'" in lines[0] and str(config_file) in lines[0]
    assert elapsed < 60
    assert not (tmp_path / "run").exists()  # nothing started


def test_plain_python_rejects_typo(tmp_path, config_file):
    result = subprocess.run(
        [sys.executable, str(REPO / "launch/train.py"), "--config", str(config_file), "run.resum=auto"],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "did you mean 'run.resume'" in result.stderr


def test_error_names_the_sibling_base_that_set_the_key(tmp_path, config_file):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("train:\n  grad_clip: abc\n")
    second.write_text("train:\n  seed: 3\n")
    data = yaml.safe_load(config_file.read_text())
    data["extends"] = [*data["extends"], str(first), str(second)]
    data["train"].pop("grad_clip", None)
    write_config(config_file, data)
    message = error_of(config_file)
    assert message.startswith(f"{first}: config key 'train.grad_clip' = 'abc'")


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(REPO) for p in REPO.glob("configs/*/*.yaml") if p.parent.name != "base")
)
def test_every_shipped_config_is_valid(path):
    cfg = load_config(REPO / path)
    assert cfg.train.max_steps > 0


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in REPO.glob("configs/base/*.yaml")))
def test_a_preset_given_as_the_config_says_it_names_no_method(path):
    with pytest.raises(ConfigError, match=r"names no method .* a preset without one is for configs .* to extend"):
        load_config(REPO / path)


def test_m2_accumulation_must_match_grad_accum():
    message = error_of(REPO / "configs/m2_encoder/demo.yaml", ["train.grad_accum=3"])
    assert "method.loss.accumulation_steps=2" in message and "train.grad_accum=3" in message


def test_space2_config_errors_name_the_key():
    demo = REPO / "configs/space2/demo.yaml"
    assert "'method.views.0'" in error_of(demo, ["method.views=[DX]"])
    message = error_of(demo, ["data.train.sources.1.name=labelled"])
    assert "data.train" in message and "distinct source names" in message
    assert "method.project" in error_of(demo, ["method.project=false"])
    assert load_config(demo, ["method.project=false", "method.views=[I]"]).method.views == ["I"]


def test_a_section_of_several_kinds_is_named_as_configs_write_it():
    """`method.loss` is contrastive or sigmoid by its `name`: set key by key without it, the message asks for the
    name; with it, errors name the key without the kind pydantic puts in between (`method.loss.contrastive.`)."""
    clip = REPO / "configs/clip/demo.yaml"
    with pytest.raises(ConfigError, match=r"config key 'method.loss' needs its 'name' beside the other keys"):
        load_config(clip, ["method.loss.tile_size=4"])
    with pytest.raises(ConfigError, match=r"config key 'method.loss.tile_size' = 0: Input should be greater than 0"):
        load_config(clip, ["method.loss.name=contrastive", "method.loss.tile_size=0"])


def test_a_shipped_config_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_path = load_config(REPO / "configs/m2_encoder/0.4b.yaml")
    for name in ("m2_encoder/0.4b", "m2_encoder/0.4b.yaml", "configs/m2_encoder/0.4b"):
        assert load_config(name) == by_path, name
    with pytest.raises(
        ConfigError, match=r"^config file not found: m2_encoder/0.5b \(nor a shipped config: clip/demo, "
    ):
        load_config("m2_encoder/0.5b")


def test_the_wheel_carries_the_shipped_configs(tmp_path):
    """Built as pip builds it (from a copy of the sources: no earlier build folder) and unpacked outside the
    checkout: `--config m2_encoder/0.4b` reads its copy."""
    import shutil

    sources = tmp_path / "sources"
    for part in ("mmpt", "data", "losses", "configs"):
        shutil.copytree(REPO / part, sources / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, sources / part)
    wheel = [sys.executable, "-m", "pip", "wheel", str(sources), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*wheel, "-w", str(tmp_path)], check=True, capture_output=True)
    import zipfile

    unpacked = tmp_path / "site"
    zipfile.ZipFile(next(tmp_path.glob("mmpt-*.whl"))).extractall(unpacked)
    code = (
        "from mmpt.config import read_config; print(read_config('m2_encoder/0.4b')[2]); "
        "from mmpt.models.open_clip_model import preprocess_settings; "  # the open_clip demo's model, by name
        "print(preprocess_settings(read_config('open_clip/demo')[0]['method']['model'])['image_size'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**launcher_env(), "PYTHONPATH": str(unpacked)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == [str(unpacked / "mmpt/configs/m2_encoder/0.4b.yaml"), "64"]


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "data.eval=[{datset: x, task: intent}]",
            "<command line>: unknown config key 'data.eval.0.datset' (did you mean 'data.eval.0.dataset'?)",
        ),
        ("data.eval=[{task: intent}]", "<command line>: required config key 'data.eval.0.dataset' is missing"),
        (
            "data.eval=[{dataset: a/x, task: intent}, {dataset: b/x, task: intent}]",
            "<command line>: config key 'data.eval': evaluation sets need distinct names",
        ),
        (  # its closing brackets lost to the shell's quoting: not read as the string '[{dataset: x'
            "data.eval=[{dataset: x",
            "<command line>: override data.eval='[{dataset: x' is not a whole YAML value: expected ',' or '}'",
        ),
    ],
)
def test_an_evaluation_list_given_on_the_command_line_is_named_there(override, says):
    """Errors in `data.eval` entries name the command line that wrote the list, not the config it replaced, and a
    misspelt key by its misspelling (it is also a missing one)."""
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/space2/demo.yaml", [override])
    assert str(err.value).startswith(says), str(err.value)


def test_a_shard_pattern_yaml_cannot_read_stays_the_string_given():
    cfg = load_config(REPO / "configs/clip/demo.yaml", ["data.train.sources.0.shards=*.tar"])
    assert cfg.data.train.sources[0].shards == "*.tar"

"""`train.eval_every`: the data.eval sets evaluated while training, reported as eval/<set>/<language>/<metric>,
leave training exactly as it would be without them, and a run stopped after an evaluation resumes exactly."""

import json
import re

import pytest

from conftest import REPO, read_metrics, small_clip_demo, step_losses, tiny_config, train_in_process, write_config
from pool import scenario


def config(digits_root, run_dir, zero_stage, **train):
    cfg = tiny_config(digits_root, run_dir, train={"max_steps": 4, "save_every": 0, **train})
    cfg["train"]["zero_stage"] = zero_stage
    cfg["data"]["eval"] = [  # the text tower has dropout: an evaluation that moved the RNG would change training
        {"dataset": str(digits_root / "zeroshot"), "task": "zeroshot_classification", "languages": ["en", "zh"]},
        {
            "dataset": str(digits_root / "zeroshot/retrieval_zh.jsonl"),
            "task": "zeroshot_retrieval",
            "name": "digits_retrieval",
            "languages": ["zh"],
        },
    ]
    return cfg


def weights(run_dir):
    return (run_dir / "model.safetensors").read_bytes()


def evaluations(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if any(k.startswith("eval/") for k in r)}


def pair_of_runs(stage: int) -> tuple[str, str]:
    """Scenarios of the pool of ranks: a run without evaluations and the same run evaluated while training (at
    ZeRO-2 stopped at step 2, right after an evaluation and a checkpoint, then resumed to step 4)."""
    plain, evaluated = f"eval-plain-zero{stage}", f"eval-evaluated-zero{stage}"

    @scenario(plain)
    def build_plain(corpora, run_dir):
        return config(corpora["digits"], run_dir, stage), [], "train"

    @scenario(evaluated)
    def build_evaluated(corpora, run_dir):
        if stage == 0:
            return config(corpora["digits"], run_dir, stage, eval_every=2), [], "train"
        return config(corpora["digits"], run_dir, stage, eval_every=1, save_every=2), [], "stop_at:2"

    return plain, evaluated


PAIRS = {stage: pair_of_runs(stage) for stage in (0, 2)}


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [pytest.param(s, marks=pytest.mark.pool(*PAIRS[s])) for s in PAIRS])
def test_evaluating_while_training_changes_nothing_and_resumes_exactly(rank_pool, zero_stage):
    plain, evaluated_dir = (rank_pool.run_dir(name) for name in PAIRS[zero_stage])
    logged = [r["step"] for r in read_metrics(evaluated_dir) if "loss/total" in r]
    assert logged == [1, 2, 3, 4], f"steps logged {logged}: the second start did not resume at step 2"
    assert step_losses(plain) == step_losses(evaluated_dir)
    assert weights(plain) == weights(evaluated_dir)  # bit for bit
    during = evaluations(evaluated_dir)
    expected_steps = {2, 4} if zero_stage == 0 else {1, 2, 3, 4}
    assert set(during) == expected_steps, sorted(during)  # every eval_every steps, and at the end
    assert set(evaluations(plain)) == {4}  # eval_every 0: at the end only
    for record in during.values():
        for language in ("en", "zh"):
            assert 0 <= record[f"eval/zeroshot/{language}/acc1"] <= 1
        assert 0 <= record["eval/digits_retrieval/zh/text_retrieval_recall@1"] <= 1
        assert record["eval/zeroshot/seconds"] > 0


def test_an_evaluation_that_draws_random_numbers_and_switches_modes_leaves_both_as_they_were():
    import random

    import numpy as np
    import torch

    from mmpt.engine.evaluation import untouched

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    model[0].eval()  # a module kept in eval mode while training (a frozen tower) stays so

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = draws()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with untouched(model):
        model.eval()
        draws(), draws()
    assert draws() == expected
    assert model.training and not model[0].training and model[1].training


def test_eval_every_on_the_clip_demo_evaluates_its_sets_at_those_steps_and_at_the_end(
    tmp_path, digits_root, process_group_of_one
):
    """The README's demo config with `train.eval_every=5` over 10 steps: its data.eval sets (the held-out digits
    and digits_unseen, in English and Chinese) logged at step 5 and at step 10, in this process at a tiny size."""
    run_dir = tmp_path / "run"
    cfg = small_clip_demo(
        digits_root,
        run_dir,
        "train.eval_every=5",
        "train.max_steps=10",
        "data.train.batch_size=8",
        "data.train.shuffle_buffer=20",
        "train.log_every=5",
    )
    train_in_process(cfg)
    evaluated = evaluations(run_dir)
    assert sorted(evaluated) == [5, 10], sorted(evaluated)
    for record in evaluated.values():
        for name in ("digits", "digits_unseen"):
            for language in ("en", "zh"):
                assert 0 <= record[f"eval/{name}/{language}/acc1"] <= 1, record
    records = sorted(path.name for path in (run_dir / "eval").glob("*.json"))  # the end's, CLIP_benchmark style
    assert records == sorted(
        f"zeroshot_classification_{name}_{language}.json"
        for name in ("digits", "digits_unseen")
        for language in ("en", "zh")
    ), records


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.eval_every=5", "data.eval=[]"], "config key 'train.eval_every' = 5: there is no data.eval set"),
        (
            ["train.eval_every=20", "train.max_steps=10"],
            "config key 'train.eval_every' = 20 is more than train.max_steps",
        ),
    ],
)
def test_an_eval_every_that_would_evaluate_nothing_is_refused_before_the_run_starts(overrides, says):
    from mmpt.config import ConfigError
    from mmpt.config_loader import load_config
    from mmpt.engine.preflight import check_eval_every

    cfg = load_config(REPO / "configs/clip/demo.yaml", overrides)  # a config loads: a saved one must
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_eval_every(cfg)


def test_a_saved_config_with_the_former_method_zeroshot_section_loads_as_data_eval_sets():
    """Releases' config.json and runs' config.yaml written before data.eval named every evaluation set keep
    their zero-shot sets in `method.zeroshot`: they load, those sets read as data.eval entries, with a warning."""
    from mmpt.config_loader import load_config
    from mmpt.release import model_config

    legacy = {
        "name": "clip",
        "tokenizer": "tokenizer.json",
        "zeroshot": {
            "dataset": "digits",
            "extra_datasets": ["digits_unseen"],
            "languages": ["en", "zh"],
            "batch_size": 64,
            "foreign_class_names": False,
        },
    }
    with pytest.warns(FutureWarning, match=r"'method.zeroshot' is read as data.eval entries \(digits, digits_unseen\)"):
        cfg = model_config(legacy)
    assert [(s.dataset, s.task, s.languages) for s in cfg.data.eval] == [
        ("digits", "zeroshot_classification", ["en", "zh"]),
        ("digits_unseen", "zeroshot_classification", ["en", "zh"]),
    ]
    assert cfg.method.eval_batch_size == 64  # type: ignore[attr-defined]
    with pytest.warns(FutureWarning, match="no evaluation set"):
        cfg = model_config({**legacy, "zeroshot": {"dataset": None, "languages": ["en"]}})
    assert cfg.data.eval == []
    # a set named in both places is one set
    with pytest.warns(FutureWarning):
        cfg = load_config(REPO / "configs/clip/demo.yaml", ["method.zeroshot={dataset: digits, languages: [en, zh]}"])
    assert [s.label for s in cfg.data.eval] == ["digits", "digits_unseen"]


@pytest.mark.parametrize(
    "config, section, task",
    [
        (
            "victor/demo.yaml",
            {"retrieval": {"dataset": "moving_digits", "languages": ["zh"], "batch_size": 8}},
            "zeroshot_retrieval",
        ),
        ("space2/demo.yaml", {"intent_eval": {"dataset": "dialogs", "shots": [5]}}, "intent"),
    ],
)
def test_a_saved_config_naming_its_evaluation_set_in_the_method_section_loads_as_data_eval_sets(config, section, task):
    """VICTOR's and SPACE-2's saved configs named their evaluation set in `method.retrieval` and `method.intent_eval`:
    it reads as a data.eval entry (with a warning), the section's other keys stay."""
    from mmpt.config import read_config
    from mmpt.config_loader import validate_config

    data, origins, top = read_config(REPO / "configs" / config, ["data.eval=[]"])
    name, legacy = next(iter(section.items()))
    data["method"][name] = legacy
    with pytest.warns(FutureWarning, match=rf"'method.{name}' is read as data.eval entries \(\w+\)"):
        cfg = validate_config(data, origins, top)
    assert [(s.dataset, s.task, s.languages) for s in cfg.data.eval] == [
        (legacy["dataset"], task, legacy.get("languages", ["en"]))
    ]
    kept = {k: v for k, v in legacy.items() if k not in ("dataset", "languages")}
    assert getattr(cfg.method, name).model_dump().items() >= kept.items()


def test_the_warning_names_the_file_that_names_the_set_in_the_method_section(tmp_path):
    """A config of one's own extending a demo: the warning names that file (not the demo, which set the section
    first), and says when the set it names is in data.eval already."""
    from mmpt.config_loader import load_config

    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: [space2/demo]\nmethod: {intent_eval: {dataset: dialogs, shots: [5]}}\n")
    with pytest.warns(FutureWarning, match=re.escape(f"{mine}: 'method.intent_eval' is read as no new evaluation set")):
        cfg = load_config(mine)
    assert [s.dataset for s in cfg.data.eval] == ["dialogs"] and cfg.method.intent_eval.shots == [5]  # type: ignore[attr-defined]


def test_a_final_evaluation_that_failed_runs_when_the_finished_run_is_started_again(
    tmp_path, digits_root, process_group_of_one, capsys, monkeypatch
):
    """The evaluation set is moved away while the run trains, so its final evaluation fails after the weights are
    written; once the set is back, the same command evaluates the finished run instead of saying it is done."""
    from mmpt.config_loader import load_config
    from mmpt.engine.hooks import observing

    run_dir, listing = tmp_path / "run", tmp_path / "retrieval.jsonl"
    records = [json.loads(line) for line in (digits_root / "zeroshot/retrieval_zh.jsonl").read_text().splitlines()]
    listing.write_text(
        "".join(json.dumps({**r, "image": str(digits_root / "zeroshot" / r["image"])}) + "\n" for r in records)
    )
    cfg = tiny_config(digits_root, run_dir, train={"max_steps": 2, "save_every": 0})
    cfg["data"]["eval"] = [{"dataset": str(listing), "task": "zeroshot_retrieval", "languages": ["zh"]}]
    config = write_config(tmp_path / "cfg.yaml", cfg)

    def move_the_set_away(point: str, step: int) -> None:
        if point == "step" and step == 2 and listing.exists():
            listing.rename(tmp_path / "moved.jsonl")

    with observing(move_the_set_away), pytest.raises(Exception, match="retrieval.jsonl"):
        train_in_process(load_config(config))
    assert (run_dir / "model.safetensors").is_file() and not (run_dir / "final_evaluation.json").exists()
    (tmp_path / "moved.jsonl").rename(listing)
    capsys.readouterr()
    with monkeypatch.context() as patched:  # a finished run's restart builds no engine, loads no checkpoint
        patched.setattr("mmpt.engine.run.build_engine", lambda *a, **k: pytest.fail("built an engine"))
        train_in_process(load_config(config))
    said = capsys.readouterr().out
    assert (
        "already finished at step 2 (train.max_steps=2): its final evaluation did not complete; evaluating now" in said
    )
    final = json.loads((run_dir / "final_evaluation.json").read_text())
    assert final["step"] == 2 and 0 <= final["metrics"]["eval/retrieval/zh/image_retrieval_recall@1"] <= 1
    assert read_metrics(run_dir)[-1] == {"step": 2, **final["metrics"]}
    train_in_process(load_config(config))
    assert "nothing to do" in capsys.readouterr().out
    # a set added to the finished run's config: its evaluation at the end runs again, over both sets
    added = f"{{dataset: {digits_root / 'zeroshot'}, task: zeroshot_classification, name: held, languages: [en]}}"
    train_in_process(load_config(config, [f"data.eval=[{{dataset: {listing}, task: zeroshot_retrieval}}, {added}]"]))
    said = capsys.readouterr().out
    assert "its final evaluation covered retrieval, the config names retrieval, held; evaluating now" in said, said
    assert 0 <= json.loads((run_dir / "final_evaluation.json").read_text())["metrics"]["eval/held/en/acc1"] <= 1

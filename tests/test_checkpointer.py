"""The checkpointer saves and restores whatever parts a run registers, without naming them: a new stateful
part is a `register` call, not an edit of the checkpoint code. One process, a stand-in for DeepSpeed's engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mmpt.engine.checkpoint import Checkpointer, find_resume


class Counter:
    """A rank part: a number that must continue exactly, and what happened to it."""

    def __init__(self, value: int = 0):
        self.value, self.events = value, []

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
        self.events.append("exact")

    def load_resharded(self, states, step):
        self.value = sum(s["value"] for s in states)
        self.events.append(f"resharded at {step}")


class SeesCounter(Counter):
    """A part that notes what an earlier-registered part held when this one was loaded."""

    def __init__(self, counter: Counter):
        super().__init__()
        self.counter, self.saw = counter, None

    def load_state_dict(self, state):
        self.saw = self.counter.value


class StandInEngine:
    """What the checkpointer uses of a DeepSpeed engine: its checkpoint writer, save and load."""

    def __init__(self):
        self.module = nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.checkpoint_engine = self
        self.synced: list[str] = []

    def save(self, state, path):
        torch.save(state, path)

    def save_checkpoint(self, root, tag, client_state, save_latest):
        folder = Path(root, tag)
        folder.mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(
            {"module": self.module.state_dict(), **client_state}, str(folder / "mp_rank_00_model_states.pt")
        )

    def load_checkpoint(self, root, tag):
        state = torch.load(Path(root, tag, "mp_rank_00_model_states.pt"), weights_only=False)
        self.module.load_state_dict(state["module"])
        return root, state


def test_registered_parts_are_saved_and_restored_in_their_order(tmp_path):
    reached = []
    saver = Checkpointer(tmp_path, keep_last=2, layout=(1, 2), reached=lambda point, step: reached.append(point))
    counter = Counter(41)
    saver.register("counter", counter)
    saver.register("later", SeesCounter(counter))
    engine = StandInEngine()
    saved = saver.save(engine, step=7)
    assert json.loads((saved / "complete.json").read_text()) == {"step": 7, "world_size": 1}
    assert reached == ["save:after_engine", "save:after_rank_state", "save:before_latest", "save:before_prune"]
    assert torch.load(saved / "rank_0.pt", weights_only=True)["counter"] == {"value": 41}

    restorer = Checkpointer(tmp_path, keep_last=2, layout=(1, 2), reached=lambda point, step: None)
    again = Counter()
    later = SeesCounter(again)
    restorer.register("counter", again)
    restorer.register("later", later)
    checkpoint = find_resume(tmp_path, "auto")
    step, layout = restorer.restore(StandInEngine(), checkpoint, checkpoint)
    assert (step, layout, again.value, again.events) == (7, [1, 2], 41, ["exact"])
    assert later.saw == 41  # parts load in the order they registered


def test_another_layout_hands_every_saved_state_to_each_part(tmp_path):
    saver = Checkpointer(tmp_path, keep_last=1, layout=(1, 2), reached=lambda point, step: None)
    saver.register("counter", Counter(5))
    saver.save(StandInEngine(), step=3)
    restorer = Checkpointer(tmp_path, keep_last=1, layout=(2, 2), reached=lambda point, step: None)
    moved = Counter()
    restorer.register("counter", moved)
    checkpoint = find_resume(tmp_path, "auto")
    restorer.restore(StandInEngine(), checkpoint, checkpoint)
    assert (moved.value, moved.events) == (5, ["resharded at 3"])


def test_a_part_name_is_registered_once(tmp_path):
    import pytest

    saver = Checkpointer(tmp_path, keep_last=1, layout=(1,), reached=lambda point, step: None)
    saver.register("data", Counter())
    with pytest.raises(ValueError, match="already registered"):
        saver.register("data", Counter())
    with pytest.raises(ValueError, match="already registered"):
        saver.register("layout", Counter())

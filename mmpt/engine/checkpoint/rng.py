"""Every random number generator a step draws from, as a checkpointable part (numpy's state as tensors and
plain numbers, so a rank state loads with `weights_only=True`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RngState:
    """The process's RNG as a rank part. In another layout the saved streams belong to other ranks, so the
    generators are seeded anew from the step (`reseed(step)`)."""

    def __init__(self, reseed: Callable[[int], None]):
        self.reseed = reseed

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)

    def load_resharded(self, states: Sequence[Any], step: int) -> None:
        self.reseed(step)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _numpy_state_to_plain(state: Any) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)

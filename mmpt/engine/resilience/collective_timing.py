"""Time every collective a rank runs, per logging window, at the cost of two clock reads per call.

Wrapped: `torch.distributed`'s collectives and those of DeepSpeed's communication backend
(`deepspeed_private.comm_backend`), whose ZeRO code calls `torch.distributed` through references taken at its start,
so wrapping `torch.distributed` alone would miss its traffic; a call made inside another wrapped call counts once,
as the outer call. Recorded per window: for each collective kind and group, the calls, bytes (the larger of a
call's buffers) and seconds; for synchronous calls also when the rank arrived and when the call returned, from the
instant the previous logging step's small all-gather returned (shared by all ranks, so no synchronised clocks are
needed). On a GPU each synchronous call records two CUDA events, read at `take()` once per window; asynchronous
calls count their bytes and issue time. How arrival and return tell a straggler from a slow link, and why:
docs/fault_tolerance.md ("Rank health").
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mmpt.engine import deepspeed_private
from mmpt.engine.timing import Clock

# function name -> kind, for torch.distributed and DeepSpeed's backend object alike
_KIND_OF = {
    "all_reduce": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",  # mmpt's reduce-scatter on gloo, which has none
    "scatter_object_list": "scatter",
    "barrier": "barrier",
}
KINDS = tuple(dict.fromkeys(_KIND_OF.values()))

Delay = Callable[[str], None]  # an injected fault, called with the collective's kind


@dataclass
class Totals:
    """One (kind, group)'s figures in a window."""

    calls: int = 0
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class Window:
    """One rank's logging window, in seconds from the window's reference instant."""

    wall: float  # reference to the end of the window's work
    collective_seconds: float  # in synchronous collectives
    sync_calls: int
    mean_arrival: float  # when this rank reached its synchronous calls, on average
    mean_return: float  # when they returned, on average
    by_kind: dict[tuple[str, str], Totals] = field(default_factory=dict)  # (kind, group) -> totals

    @property
    def busy(self) -> float:
        """Time outside synchronous collectives: this rank's own work (data, compute, optimizer, host)."""
        return max(0.0, self.wall - self.collective_seconds)

    def kind_totals(self, kind: str) -> Totals:
        out = Totals()
        for (name, _), totals in self.by_kind.items():
            if name == kind:
                out.calls += totals.calls
                out.bytes += totals.bytes
                out.seconds += totals.seconds
        return out


_DELAYS: list[Delay] = []  # run after each synchronous call, timed with it
_LATE_STARTS: list[Delay] = []  # run before each call starts, outside its timing


def add_delay(delay: Delay) -> None:
    """Run `delay(kind)` after every synchronous collective returns, inside its timing (the tests' slow link)."""
    _DELAYS.append(delay)


def add_late_start(delay: Delay) -> None:
    """Run `delay(kind)` before every collective starts, outside its timing (the tests' slow rank: own work
    that takes longer, up to each collective, inside backward's bucketed reductions too)."""
    _LATE_STARTS.append(delay)


def remove_delay(delay: Delay) -> None:
    """Undo `add_delay` or `add_late_start` (a process that trains several runs, one of them slowed)."""
    for delays in (_DELAYS, _LATE_STARTS):
        if delay in delays:
            delays.remove(delay)


class CollectiveClock:
    """This rank's collective timings since the last `take()`."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.clock = Clock(cuda)  # the engine's device-or-host clock
        self.delays, self.late_starts = _DELAYS, _LATE_STARTS
        self.seconds_so_far = 0.0  # host seconds in collectives since the start (a late start's own work excludes them)
        self._local = threading.local()
        self._group_names: dict[Any, str] = {}
        self._reset(self.clock.mark())

    def _reset(self, reference: Any) -> None:
        self._reference = reference
        self._totals: dict[tuple[str, str], Totals] = defaultdict(Totals)
        self._sync: list[tuple[tuple[str, str], Any, Any]] = []  # (key, arrived, returned) marks
        self._last_raw_return: Any = reference
        self._last_return: Any = reference  # after any injected delay
        self._carried = 0.0  # an injected delay of the call the reference was taken at: collective time

    # -- recording --------------------------------------------------------------------------------------
    def _group_name(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        name = self._group_names.get(group)
        if name is None:
            ranks = dist.get_process_group_ranks(group)
            name = "world" if len(ranks) == dist.get_world_size() else "ranks " + ",".join(map(str, ranks))
            self._group_names[group] = name
        return name

    def call(self, kind: str, function: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one collective and note it (only the outermost of nested wrapped calls counts)."""
        if getattr(self._local, "inside", False):
            return function(*args, **kwargs)
        self._local.inside = True
        try:
            return self._timed(kind, function, args, kwargs)
        finally:
            self._local.inside = False

    def _timed(self, kind: str, function: Callable, args: tuple, kwargs: dict) -> Any:
        group = kwargs["group"] if "group" in kwargs else _positional_group(function, args)
        key = (kind, self._group_name(group))
        asynchronous = bool(kwargs.get("async_op", False))
        for delay in self.late_starts:
            delay(kind)
        host_start = time.perf_counter()
        arrived = self.clock.mark() if not asynchronous else None
        result = function(*args, **kwargs)
        if arrived is not None:
            self._last_raw_return = self.clock.mark()
            for delay in self.delays:
                delay(kind)
            returned = self.clock.mark() if self.delays else self._last_raw_return
            self._last_return = returned
            self._sync.append((key, arrived, returned))
        totals = self._totals[key]
        totals.calls += 1
        totals.bytes += _buffer_bytes(args, kwargs)
        host_seconds = time.perf_counter() - host_start
        self.seconds_so_far += host_seconds
        if asynchronous:
            totals.seconds += host_seconds
        return result

    def mark_reference(self) -> None:
        """The return of the last synchronous call (before any injected delay) becomes the next window's
        reference: call it right after a collective every rank left together."""
        delayed = Clock.seconds(self._last_raw_return, self._last_return) if self.delays else 0.0
        self._reset(self._last_raw_return)
        self._carried = delayed  # the slow link's wait after that call falls in the new window: not busy time

    def take(self) -> Window:
        """This window's figures, then start the next one from now (until `mark_reference`)."""
        end = self.clock.mark()
        Clock.wait(end)
        wall = Clock.seconds(self._reference, end)
        arrivals = returns = collective = 0.0
        for key, arrived, returned in self._sync:
            start, stop = Clock.seconds(self._reference, arrived), Clock.seconds(self._reference, returned)
            arrivals += start
            returns += stop
            collective += stop - start
            self._totals[key].seconds += stop - start
        collective += self._carried
        count = len(self._sync)
        window = Window(
            wall=wall,
            collective_seconds=collective,
            sync_calls=count,
            mean_arrival=arrivals / count if count else 0.0,
            mean_return=returns / count if count else 0.0,
            by_kind=dict(self._totals),
        )
        self._reset(end)
        return window


_PARAMETERS: dict[Any, list[str]] = {}  # a wrapped function's parameter names, read once


def _positional_group(function: Callable, args: tuple) -> Any:
    """The `group` argument when it was passed by position (rare: mmpt and DeepSpeed pass it by keyword)."""
    key = getattr(function, "__func__", function)  # a bound method's function: one entry for every call
    names = _PARAMETERS.get(key)
    if names is None:
        try:
            names = list(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            names = []
        _PARAMETERS[key] = names
    if "group" in names and names.index("group") < len(args):
        return args[names.index("group")]
    return None


def _buffer_bytes(args: tuple, kwargs: dict) -> float:
    """The larger of the call's tensor buffers (a tensor, or a list of them summed)."""
    largest = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            largest = max(largest, value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            largest = max(largest, sum(v.numel() * v.element_size() for v in value))
    return float(largest)


_ACTIVE: CollectiveClock | None = None
_ORIGINALS: list[tuple[Any, str, Any]] = []  # (owner, name, original; None: the class's method), to restore
_WRAPPED: set[Callable] = set()


def active() -> CollectiveClock | None:
    """The installed clock, or None."""
    return _ACTIVE


def _wrap(clock: CollectiveClock, owner: Any, name: str) -> None:
    original = getattr(owner, name, None)
    if original is None or original in _WRAPPED:
        return
    kind = _KIND_OF[name]

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        return clock.call(kind, original, args, kwargs)

    _WRAPPED.add(timed)
    _ORIGINALS.append((owner, name, vars(owner).get(name)))
    setattr(owner, name, timed)


def install(cuda: bool) -> CollectiveClock:
    """Wrap the collectives of `torch.distributed` and of DeepSpeed's backend (once) and return the clock."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    clock = CollectiveClock(cuda)
    for name in _KIND_OF:
        _wrap(clock, dist, name)
    backend = deepspeed_private.comm_backend()
    if backend is not None:
        for name in _KIND_OF:
            _wrap(clock, backend, name)
    _ACTIVE = clock
    return clock


def uninstall() -> None:
    """Put the original functions back."""
    global _ACTIVE
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _WRAPPED.clear()
    _ACTIVE = None

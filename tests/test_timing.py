"""The engine's one device-or-host clock (`mmpt.engine.timing.Clock`) and the spans timed with it."""

import time

import pytest


def test_spans_add_up_repeated_spans_on_the_host_clock():
    from mmpt.engine.timing import Spans

    spans = Spans(cuda=False)
    for _ in range(2):
        spans.start("forward")
        time.sleep(0.01)
        spans.stop("forward")
    spans.start("data")
    spans.stop("data")
    totals = spans.take()
    assert 0.02 <= totals["forward"] < 0.5 and 0 <= totals["data"] < 0.01
    assert spans.take() == {}  # a take starts over


def test_the_clock_measures_between_two_of_its_own_marks():
    from mmpt.engine.timing import Clock

    clock = Clock(cuda=False)
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    clock.wait(end)  # nothing to wait for on the host
    assert 0.01 <= clock.seconds(start, end) < 0.5
    with pytest.raises(TypeError):
        clock.seconds(start, object())  # type: ignore[arg-type]

"""How a stream waits for the engine (streaming/windows.py ``answer``): at most its ``engine_timeout_s``, then
its request is cancelled and EngineTimeout says how long it waited; an answer or an error that came is
returned or raised as it is."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from qasr.streaming import EngineTimeout
from qasr.streaming.windows import answer


def test_an_answer_that_never_comes_is_given_up_on_and_cancelled() -> None:
    future: Future[int] = Future()
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match=r"^the engine has not answered for 0.2 s$"):
        answer(future, 0.2)
    assert 0.2 <= time.monotonic() - started < 5
    assert future.cancelled()


def test_an_answer_or_an_error_that_came_is_passed_on() -> None:
    done: Future[int] = Future()
    done.set_result(7)
    assert answer(done, 0.01) == 7 and answer(done, None) == 7
    failed: Future[int] = Future()
    failed.set_exception(TimeoutError("the request's own"))
    with pytest.raises(TimeoutError, match="the request's own"):
        answer(failed, 0.01)

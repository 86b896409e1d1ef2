"""ddtree.waiting.wait_until: the first truthy answer, None at the timeout or when it gives up."""
from __future__ import annotations

import itertools
import time

from ddtree.waiting import wait_until


def test_returns_the_first_truthy_answer():
    answers = iter([None, 0, "", "found", "later"])
    assert wait_until(lambda: next(answers), 5, poll_s=0.001) == "found"
    assert next(answers) == "later"


def test_none_once_the_timeout_has_passed_after_at_least_one_look():
    looks = itertools.count()
    start = time.monotonic()
    assert wait_until(lambda: next(looks) < 0, 0.05, poll_s=0.01) is None
    assert 0.05 <= time.monotonic() - start < 2
    assert next(looks) >= 2
    assert wait_until(lambda: True, 0) is True   # a zero timeout still looks once


def test_gives_up_at_once_after_a_look():
    looks = itertools.count()
    start = time.monotonic()
    assert wait_until(lambda: next(looks) < 0, 60, give_up=lambda: True) is None
    assert next(looks) == 1 and time.monotonic() - start < 1
    assert wait_until(lambda: "held", 60, give_up=lambda: True) == "held"   # the look comes first

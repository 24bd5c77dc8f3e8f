"""How often the deploy asks an instance that does not serve yet (``fleet.deploy.health``)."""

from __future__ import annotations

from itertools import islice

from fleet.deploy.health import POLL_LAST_S, poll_waits


def test_the_waits_double_from_a_tenth_of_a_second_to_one_second() -> None:
    assert list(islice(poll_waits(), 8)) == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]


def test_a_minute_of_loading_is_asked_about_once_a_second() -> None:
    waits, total = poll_waits(), 0.0
    count = 0
    while total < 60:
        total += next(waits)
        count += 1
    assert POLL_LAST_S == 1.0 and count == 63  # 0.1 + 0.2 + 0.4 + 0.8, then 1 s each (before: 60)

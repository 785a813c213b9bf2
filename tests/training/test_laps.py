"""apt_ds.training.laps: host time of consecutive parts as metrics fields."""

from __future__ import annotations

import time

import pytest

from apt_ds.training.laps import Laps


def test_each_lap_records_the_time_since_the_previous_one():
    record = {}
    laps = Laps(record, "event_", ("first", "second"))
    time.sleep(0.02)
    laps("first")
    laps("second")
    assert set(record) == {"event_first_s", "event_second_s"}
    assert record["event_first_s"] >= 0.02 > record["event_second_s"] >= 0


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown part 'third'"):
        Laps({}, "event_", ("first",))("third")

"""Host time of consecutive parts of one piece of work, as metrics fields (`event_decide_s`, ...)."""

from __future__ import annotations

import time


class Laps:
    """`laps("name")` records the host time since the previous lap (or since creation) as
    `record[f"{prefix}name_s"]`; the names must be among `parts`. Device work queued in a part is
    paid wherever the host next waits for the device, and with several ranks a part includes
    waiting for the others."""

    def __init__(self, record: dict, prefix: str, parts: tuple[str, ...]):
        self.record, self.prefix, self.parts = record, prefix, parts
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        if name not in self.parts:
            raise ValueError(f"unknown part {name!r}; expected one of {self.parts}")
        now = time.perf_counter()
        self.record[f"{self.prefix}{name}_s"] = now - self.last
        self.last = now

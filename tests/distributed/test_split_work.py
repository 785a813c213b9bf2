"""apt_ds.distributed.split_work on stand-in backends: one process computes the one part; when a
part fails on any rank, every rank raises (the lowest failing rank's error, in its own type where
it pickles), after the collective every rank enters."""

from __future__ import annotations

import pytest

from apt_ds.distributed.backend import LocalBackend
from apt_ds.distributed.split_work import _sendable, parts_from_every_rank
from apt_ds.io.modeling import ModelLoadError


class TwoRanks:
    """Rank `rank` of two; the other rank sends `other` to the all-gather."""

    world_size = 2

    def __init__(self, rank: int, other):
        self.rank, self.other, self.gathered = rank, other, 0

    def all_gather_object(self, obj) -> list:
        self.gathered += 1
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def test_one_process_computes_its_one_part():
    assert parts_from_every_rank(LocalBackend("cpu"), lambda rank, ranks: (rank, ranks)) == [(0, 1)]


def test_every_rank_gets_every_part_in_rank_order():
    backend = TwoRanks(1, ("zero", None))
    assert parts_from_every_rank(backend, lambda rank, ranks: f"part {rank} of {ranks}") == ["zero", "part 1 of 2"]


def test_another_ranks_error_is_raised_here_after_the_collective():
    backend = TwoRanks(1, (None, ModelLoadError("model.safetensors: truncated")))
    with pytest.raises(ModelLoadError, match="truncated"):
        parts_from_every_rank(backend, lambda rank, ranks: "fine")
    assert backend.gathered == 1


def test_this_ranks_error_is_sent_and_raised_with_its_traceback():
    backend = TwoRanks(0, ("fine", None))

    def fail(rank, ranks):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone") as raised:
        parts_from_every_rank(backend, fail)
    assert backend.gathered == 1 and raised.traceback[-1].name == "fail"


def test_an_error_that_does_not_pickle_goes_as_a_runtime_error_naming_it():
    class Unpicklable(ValueError):
        def __init__(self, path, why):
            super().__init__(f"{path}: {why}")

    sent = _sendable(Unpicklable("model", "bad"))
    assert isinstance(sent, RuntimeError) and str(sent) == "Unpicklable: model: bad"

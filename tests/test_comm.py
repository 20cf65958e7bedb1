"""How collectives in flight are waited for and named in errors (gravac.comm), in this process:
fake work objects stand for the process group's (tests/test_faults.py runs real gloo ranks)."""

from __future__ import annotations

import datetime
import pickle
import time

import pytest
import torch

import gravac
from gravac.comm import Arrival, CollectiveError, Communicator, StepTimeoutError, _Part, collect

#: the message of a fake collective that failed
BROKEN = "Connection reset by peer"


class FakeWork:
    """A work object that completes at ``done_at`` (``time.monotonic()``; ``None``: never),
    failing with ``error`` where one is given; ``wait`` honours its timeout as torch's."""

    def __init__(self, done_at: float | None = 0.0, error: str | None = None) -> None:
        self.done_at, self.error = done_at, error
        self.waits: list[datetime.timedelta | None] = []

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if not self.is_completed():
            if timeout is None:
                raise AssertionError("waited without a timeout for a work that never completes")
            until = time.monotonic() + timeout.total_seconds()
            if self.done_at is not None:
                until = min(until, self.done_at)
            time.sleep(max(0.0, until - time.monotonic()))
            if not self.is_completed():
                raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def part(work: FakeWork, kind: str = "all-gather", *, ago: float = 0.0, **kw: object) -> _Part:
    """A collective started ``ago`` seconds ago."""
    return _Part(work, kind, time.monotonic() - ago, **kw)  # type: ignore[arg-type]


def test_an_arrival_is_made_once_after_every_collective() -> None:
    made: list[int] = []

    def make() -> int:
        made.append(1)
        return len(made)

    arrival = Arrival([part(FakeWork(), timeout=None)], make)
    assert arrival.wait() == 1
    assert arrival.value() == 1  # the same result, not made again
    assert arrival.map(lambda n: n + 10).wait() == 11
    assert made == [1]


def test_a_failed_collective_is_named_with_its_step_and_the_groups_message_once() -> None:
    ok = part(FakeWork(), "all-reduce", ago=2.0, timeout=None)
    broken = part(FakeWork(error=BROKEN), ago=1.0, timeout=None)
    payload = Arrival([broken], lambda: None).named("unit 3's payload")
    with pytest.raises(CollectiveError) as exc:
        collect([Arrival([ok], lambda: None).named("the step's scalars"), payload], 7).wait()
    assert str(exc.value) == f"gravac step 7: the all-gather of unit 3's payload failed: {BROKEN}"
    assert (exc.value.step, exc.value.cause) == (7, BROKEN)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # one error, not two


def test_the_first_collective_to_fail_in_start_order_is_named() -> None:
    late = Arrival([part(FakeWork(error="late"), ago=1.0, timeout=None)], lambda: None)
    early = Arrival([part(FakeWork(error="early"), ago=2.0, timeout=None)], lambda: None)
    with pytest.raises(CollectiveError, match="of the scalars failed: early"):
        collect([late.named("the payload"), early.named("the scalars")]).wait()


def test_outside_a_step_an_unnamed_collective_says_what_it_was() -> None:
    with pytest.raises(CollectiveError, match=r"^gravac: an all-reduce failed: gone$"):
        Arrival([part(FakeWork(error="gone"), "all-reduce", timeout=None)], lambda: None).wait()


def test_a_collective_not_complete_at_its_deadline_raises_the_step_timeout() -> None:
    stuck = FakeWork(done_at=None)
    arrival = Arrival([part(stuck, timeout=0.2)], lambda: None, step=4).named("unit 0's payload")
    began = time.monotonic()
    with pytest.raises(StepTimeoutError) as exc:
        arrival.wait()
    assert time.monotonic() - began >= 0.15  # waited for it from its start, once
    assert str(exc.value).startswith(
        "gravac step 4: the all-gather of unit 0's payload did not complete within "
        "step_timeout=0.2 s"
    )
    assert "uneven inputs: train inside torch.distributed.algorithms.Join([opt])" in str(exc.value)
    assert isinstance(exc.value, CollectiveError) and isinstance(exc.value, RuntimeError)


def test_a_collective_past_its_deadline_is_not_waited_for_again() -> None:
    """Started longer ago than the timeout and not complete: no wait at all (a zero timeout
    would be no timeout to torch)."""
    stuck = FakeWork(done_at=None)
    with pytest.raises(StepTimeoutError):
        Arrival([part(stuck, ago=5.0, timeout=1.0)], lambda: None).wait()
    assert stuck.waits == []


def test_a_failure_seen_after_the_deadline_is_a_failure_not_a_timeout() -> None:
    """A peer died early, the error is read later than the timeout: the group's message."""
    broken = FakeWork(error=BROKEN)
    with pytest.raises(CollectiveError) as exc:
        Arrival([part(broken, ago=5.0, timeout=1.0)], lambda: None).wait()
    assert not isinstance(exc.value, StepTimeoutError)
    assert exc.value.cause == BROKEN


def test_a_collective_that_completes_in_time_is_not_an_error() -> None:
    soon = FakeWork(done_at=time.monotonic() + 0.05)
    assert Arrival([part(soon, timeout=2.0)], lambda: "arrived").wait() == "arrived"


@pytest.mark.parametrize(
    "error",
    [CollectiveError("the all-gather of x", BROKEN, 3), StepTimeoutError("the all-gather", 3, 2)],
)
def test_the_errors_pickle_and_are_exported(error: CollectiveError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert gravac.CollectiveError is CollectiveError
    assert gravac.StepTimeoutError is StepTimeoutError


def test_one_rank_keeps_its_own_tensor_in_a_new_one_for_every_exchange() -> None:
    """A group of one rank (a node of one, no process group here) exchanges nothing: its
    reduce-scatter, all-to-all and all-gather give back ``tensor`` itself, in a new tensor
    (the caller may change ``tensor`` once it has arrived)."""
    one = Communicator()
    assert one.world_size == 1
    tensor = torch.arange(6.0)
    for arrived in (
        one.reduce_scatter_async(tensor).wait(),
        one.all_to_all_async(tensor).wait(),
        one.all_gather_into(torch.empty(6), tensor),
    ):
        assert torch.equal(arrived, tensor) and arrived.data_ptr() != tensor.data_ptr()

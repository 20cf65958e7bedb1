"""A node's dense stages through shared memory (:mod:`gravac.shm`) on real gloo groups of 2
processes as one node: the mapping, the stages' sums against gloo's collectives, a region's
reuse waiting for a slow reader, and the fallbacks where a node cannot share memory."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

from gravac.comm import Communicator, StepTimeoutError
from gravac.hierarchy import Hierarchy, Topology
from gravac.shm import Region, SharedNodeStage, map_region
from tests.workers import Workers

pytestmark = pytest.mark.slow
SPAWN_TIMEOUT = 240.0
WORLD = 2
#: seconds the slow reader of a region holds it
HOLD = 0.5


def mapped_by_both(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Rank 1 writes a region that both mapped; rank 0 reads it after a barrier."""
    node = Communicator()
    mem, why = map_region(node, 64, directory=directory)
    assert mem is not None, why
    if rank == 1:
        mem[:].copy_(torch.arange(64, dtype=torch.uint8))
    node.barrier_async().wait()  # the first rank unlinked the file before it got here
    left = sorted(os.listdir(directory))
    return {"seen": mem.clone(), "left": left}


def test_a_region_is_one_memory_and_leaves_no_file(gloo_pools: Workers, tmp_path: Any) -> None:
    out = gloo_pools.run(mapped_by_both, WORLD, str(tmp_path), timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert torch.equal(out[r]["seen"], torch.arange(64, dtype=torch.uint8))
        assert out[r]["left"] == []  # unlinked once both had mapped it, yet still mapped
    assert os.listdir(tmp_path) == []


def _gradients(rank: int, step: int, numel: int) -> Tensor:
    gen = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(numel, generator=gen)


def both_ways(rank: int, world_size: int, wire: str) -> dict[str, Any]:
    """Stages 1 and 3 of a few steps of units of 35 and 1,000 elements (a region grows when a
    larger unit takes its place), through shared memory and through the collectives."""
    topology = Topology(world_size, world_size, rank)
    dtype = getattr(torch, wire)
    ways = {
        "shm": Hierarchy(topology, precision="fp16" if wire == "float16" else "fp32"),
        "collective": Hierarchy(
            topology, precision="fp16" if wire == "float16" else "fp32", stage="collective"
        ),
    }
    out: dict[str, Any] = {"shared": ways["shm"].shared is not None}
    for way, h in ways.items():
        got = []
        for step, sizes in enumerate(((35, 1000), (1000, 35), (1000, 1000))):
            h.begin_step()
            flats = [_gradients(rank, step, n) for n in sizes]
            arrivals = [h.scatter(f, lossy=dtype != torch.float32, step=step) for f in flats]
            chunks = [a.wait() for a in arrivals]
            wholes = [
                h.gather(c, n, lossy=dtype != torch.float32, step=step)
                for c, n in zip(chunks, sizes, strict=True)
            ]
            got.append((chunks, wholes))
        out[way] = got
    return out


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_the_shared_stages_are_the_collectives_bit_for_bit(gloo_pools: Workers, wire: str) -> None:
    out = gloo_pools.run(both_ways, WORLD, wire, timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert out[r]["shared"]
        for (c1, w1), (c2, w2) in zip(out[r]["shm"], out[r]["collective"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(c1, c2, strict=True))
            for (whole1, off1), (whole2, off2) in zip(w1, w2, strict=True):
                assert torch.equal(whole1, whole2)
                assert (off1 is None) == (off2 is None) == (wire == "float32")
                assert off1 is None or torch.equal(off1, off2)
    # the node's mean, each rank holding its chunk of it, and the whole on every rank
    for step, sizes in enumerate(((35, 1000), (1000, 35), (1000, 1000))):
        for u, n in enumerate(sizes):
            mean = (_gradients(0, step, n) + _gradients(1, step, n)) / 2
            if wire == "float32":
                whole = out[0]["shm"][step][1][u][0]
                torch.testing.assert_close(whole, mean, rtol=0, atol=1e-6)
            assert torch.equal(out[0]["shm"][step][1][u][0], out[1]["shm"][step][1][u][0])


def slow_reader(rank: int, world_size: int, timeout: float | None) -> dict[str, Any]:
    """Rank 1 reads a region's first use for :data:`HOLD` seconds; rank 0 begins its second
    use at once: when its begin returned, and what it raised."""
    node = Communicator()
    mem, why = map_region(node, Region.nbytes_for(world_size, 8))
    assert mem is not None, why
    region = Region(mem, world_size, rank)
    region.begin(timeout, "a test region", 0)
    node.barrier_async().wait()
    start, error = time.monotonic(), ""
    if rank == 1:
        time.sleep(HOLD)
        region.finish()
    else:
        region.finish()
        try:
            region.begin(timeout, "a test region", 1)
        except StepTimeoutError as exc:
            error = str(exc)
    waited = time.monotonic() - start
    node.barrier_async().wait()
    return {"waited": waited, "error": error}


def test_a_region_is_written_again_only_once_every_rank_has_read_it(gloo_pools: Workers) -> None:
    out = gloo_pools.run(slow_reader, WORLD, None, timeout=SPAWN_TIMEOUT)
    assert out[0]["error"] == ""
    assert out[0]["waited"] >= HOLD * 0.9


def test_a_reader_that_never_finishes_times_the_writer_out(gloo_pools: Workers) -> None:
    out = gloo_pools.run(slow_reader, WORLD, HOLD / 5, timeout=SPAWN_TIMEOUT)
    assert (
        "the node's reading of a test region did not complete within step_timeout=0.1 s"
        in (out[0]["error"])
    )
    assert "step 1" in out[0]["error"]


def stale(rank: int, world_size: int) -> str:
    """A node sum read after the next step's stage took its region."""
    stage = SharedNodeStage(Communicator())
    first = stage.scatter(torch.ones(8), 8, torch.float32, 0)
    stage.restart()
    second = stage.scatter(torch.ones(8), 8, torch.float32, 1)
    second.wait()
    try:
        first.wait()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_a_node_sum_read_after_its_region_was_reused_raises(gloo_pools: Workers) -> None:
    for error in gloo_pools.run(stale, WORLD, timeout=SPAWN_TIMEOUT):
        assert "a node sum (step 0) was read after its region was used again" in error


def unshareable(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Two levels where the node cannot map its memory: ``"auto"`` and ``"shm"``."""
    topology = Topology(world_size, world_size, rank)
    auto = Hierarchy(topology, directory=directory)
    error = ""
    try:
        Hierarchy(topology, stage="shm", directory=directory)
    except RuntimeError as exc:
        error = str(exc)
    chunk = auto.scatter(torch.full((6,), float(rank)), step=0).wait()
    return {"shared": auto.shared is not None, "error": error, "chunk": chunk}


def test_a_node_that_cannot_share_memory_uses_its_collectives_or_refuses(
    gloo_pools: Workers, tmp_path: Any
) -> None:
    missing = str(tmp_path / "missing")
    out = gloo_pools.run(unshareable, WORLD, missing, timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert not out[r]["shared"]
        assert torch.equal(out[r]["chunk"], torch.full((3,), 0.5))
        assert out[r]["error"].startswith("node_stage='shm', but node 0 cannot: ")
    assert f"could not create '{missing}/gravac-node-" in out[0]["error"]
    assert "the node's first rank could not create its file" in out[1]["error"]


def vanishing(rank: int, world_size: int, directory: str, stage: str) -> dict[str, Any]:
    """Two levels whose node could map its memory when they were made, and no longer can at
    the first stage (its directory removed)."""
    topology = Topology(world_size, world_size, rank)
    hierarchy = Hierarchy(topology, stage=stage, directory=directory)
    node = Communicator()
    if rank == 0:
        os.rmdir(directory)
    node.barrier_async().wait()
    hierarchy.begin_step()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            chunk = hierarchy.scatter(torch.full((6,), float(rank)), step=4).wait()
        except RuntimeError as exc:
            return {"error": str(exc)}
    return {
        "chunk": chunk,
        "shared": hierarchy.shared is not None,
        "warnings": [str(w.message) for w in seen],
    }


def test_a_node_whose_memory_fails_later_falls_back_or_raises(
    gloo_pools: Workers, tmp_path: Any
) -> None:
    (tmp_path / "auto").mkdir()
    (tmp_path / "shm").mkdir()
    auto = gloo_pools.run(vanishing, WORLD, str(tmp_path / "auto"), "auto", timeout=SPAWN_TIMEOUT)
    shm = gloo_pools.run(vanishing, WORLD, str(tmp_path / "shm"), "shm", timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert torch.equal(auto[r]["chunk"], torch.full((3,), 0.5))
        assert not auto[r]["shared"]
        (warning,) = auto[r]["warnings"]
        assert warning.startswith("two levels: the node's memory failed at step 4: ")
        assert warning.endswith("node 0 moves its stages through its group's collectives from "
                                "now on (node_stage='auto')")  # fmt: skip
        assert shm[r]["error"].startswith(
            "node_stage='shm', but node 0 cannot: the node's memory failed at step 4: "
        )

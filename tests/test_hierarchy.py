"""The nodes of two-level aggregation, planned and checked in one process
(:mod:`gravac.hierarchy`); the multi-process runs are in ``test_two_level.py``."""

from __future__ import annotations

import pytest

from gravac import GravacConfig
from gravac.hierarchy import Topology, plan_topology, torchrun_node_size


def test_a_topology_numbers_nodes_node_by_node() -> None:
    t = Topology(world_size=6, ranks_per_node=3, rank=4)
    assert (t.nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.node_ranks(1) == [3, 4, 5]
    assert t.peer_ranks(1) == [1, 4]
    assert str(t) == "2 node(s) of 3 ranks"
    assert str(Topology(4, 1, 0)) == "flat (4 ranks)"


@pytest.mark.parametrize(
    ("numel", "local_rank", "expected"),
    [(10, 0, (0, 4)), (10, 1, (4, 8)), (10, 2, (8, 10)), (2, 2, (2, 2)), (9, 2, (6, 9))],
)
def test_the_chunks_tile_a_unit(numel: int, local_rank: int, expected: tuple[int, int]) -> None:
    t = Topology(world_size=6, ranks_per_node=3, rank=3 + local_rank)
    assert t.bounds(numel) == expected
    assert t.chunk(numel) * 3 >= numel


@pytest.mark.parametrize(
    ("env", "world", "rank", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 4, 3, 2),  # 2 nodes of 2
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 4, 1, 1),  # one node: flat
        ({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}, 4, 2, 1),  # one rank a node: flat
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, 4, 3, 1),  # not numbered by node
        ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, 4, 0, 1),  # nodes of unequal size
        ({"LOCAL_WORLD_SIZE": "two", "LOCAL_RANK": "0"}, 4, 0, 1),
        ({}, 4, 0, 1),  # not torchrun
    ],
)
def test_torchrun_reports_the_nodes(
    env: dict[str, str], world: int, rank: int, expected: int
) -> None:
    assert torchrun_node_size(world, rank, env) == expected


def test_an_explicit_node_size_wins_over_torchrun() -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert plan_topology(None, 4, 0, env).ranks_per_node == 2
    assert plan_topology(1, 4, 0, env).ranks_per_node == 1
    assert plan_topology(4, 4, 0, env).ranks_per_node == 4


def test_a_node_size_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"ranks_per_node must divide the world size 4.*got 3"):
        plan_topology(3, 4, 0, {})


@pytest.mark.parametrize("value", [0, -2, 2.0, True, "2"])
def test_a_bad_ranks_per_node_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"ranks_per_node must be None or an integer >= 1"):
        GravacConfig(ranks_per_node=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["fp8", "float16", None, 16])
def test_a_bad_node_precision_is_refused(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"node_precision must be one of \('fp32', 'fp16', 'bf16'\)"
    ):
        GravacConfig(node_precision=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["gloo", "SHM", None, 1])
def test_a_bad_node_stage_is_refused(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"node_stage must be one of \('auto', 'shm', 'collective'\), got "
    ):
        GravacConfig(node_stage=value)  # type: ignore[arg-type]

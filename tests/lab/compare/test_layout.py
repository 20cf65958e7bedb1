"""``gravac compare --nodes``: the layout and its options, the nodes' namespaces and addresses,
the inter-node column (no process launched; ``test_layout_run.py`` runs it on shaped links)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gravac.cli import main
from gravac_lab.compare import cli, modes, netns
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.layout import NodeLayout
from gravac_lab.compare.report import format_table, summarise
from gravac_lab.compare.runner import CompareError
from gravac_lab.compare.study import Study, parse_variant
from tests.lab.compare import made_up

RATE = 10**9


@pytest.mark.parametrize(
    ("workers", "nodes", "ranks_per_node", "layout"),
    [
        (None, None, None, (1, 2)),  # as before nodes: 2 workers, flat
        (3, None, None, (1, 3)),
        (None, 2, 2, (2, 2)),
        (4, 2, 2, (2, 2)),  # --workers may repeat the product
        (6, 2, None, (2, 3)),  # --workers and --nodes make the ranks per node
        (6, None, 3, (2, 3)),  # ... --workers and --ranks-per-node the nodes
        (None, 3, None, (3, 1)),  # nodes of one worker each
        (None, None, 4, (1, 4)),  # one node
        (None, 1, 3, (1, 3)),
    ],
)
def test_layout_of_the_options(
    workers: int | None, nodes: int | None, ranks_per_node: int | None, layout: tuple[int, int]
) -> None:
    got = NodeLayout.of_options(workers=workers, nodes=nodes, ranks_per_node=ranks_per_node)
    assert (got.nodes, got.ranks_per_node) == layout


def _study_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Study:
    """The study ``gravac compare argv`` would run (the run itself refused)."""
    seen: list[Study] = []

    def refuse(study: Study) -> dict[str, Any]:
        seen.append(study)
        raise CompareError("not run in this test")

    monkeypatch.setattr(cli, "run_compare", refuse)
    assert main(["compare", "--quick", *argv]) == 1
    return seen[0]


def test_one_node_is_the_flat_run_of_as_many_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = _study_of(["--workers", "3"], monkeypatch).config
    one_node = _study_of(["--nodes", "1", "--ranks-per-node", "3"], monkeypatch).config
    assert one_node == flat
    assert (flat.workers, flat.nodes) == (3, 1)
    assert flat.layout.torchrun_env(0) == {}  # as before nodes: no torchrun variables
    assert flat.layout.ranks_per_host == 1  # and a namespace per worker on shaped links


def test_nodes_and_ranks_per_node_make_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _study_of(["--nodes", "2", "--ranks-per-node", "3"], monkeypatch).config
    assert (cfg.workers, cfg.nodes, cfg.layout) == (6, 2, NodeLayout(2, 3))
    assert CompareConfig.from_json(cfg.to_json()) == cfg


def test_config_refuses_nodes_that_do_not_divide_the_workers() -> None:
    with pytest.raises(ValueError, match="--workers 4 is not a multiple of --nodes 3"):
        CompareConfig(workers=4, nodes=3)
    with pytest.raises(ValueError, match="--nodes must be an integer >= 1, got 0"):
        CompareConfig(nodes=0)


def test_layout_numbers_ranks_node_by_node_as_torchrun() -> None:
    layout = NodeLayout(3, 2)
    assert layout.world_size == 6
    assert [layout.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [layout.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert list(layout.ranks(2)) == [4, 5]
    assert layout.ranks_per_host == 2
    assert layout.torchrun_env(3) == {
        "RANK": "3",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
    }
    assert layout.describe() == "3 nodes x 2 workers (ranks 0-1, 2-3, 4-5)"


def test_torchrun_variables_give_gravac_the_nodes() -> None:
    from gravac.hierarchy import torchrun_node_size

    layout = NodeLayout(2, 2)
    assert {torchrun_node_size(4, r, layout.torchrun_env(r)) for r in range(4)} == {2}
    flat = NodeLayout(1, 4)
    assert {torchrun_node_size(4, r, flat.torchrun_env(r)) for r in range(4)} == {1}


def test_a_node_s_workers_share_its_namespace_link_and_address() -> None:
    net = netns.ShapedNetwork(4, RATE, name_prefix="gvc1-", ranks_per_node=2)
    assert net.nodes == 2
    assert [net.namespace(net.node(r)) for r in range(4)] == ["gvc1-n0"] * 2 + ["gvc1-n1"] * 2
    assert [net.address(r) for r in range(4)] == ["10.213.0.1"] * 2 + ["10.213.0.2"] * 2
    assert [net.ifname(r) for r in range(4)] == ["gvc1n0"] * 2 + ["gvc1n1"] * 2
    assert net.wrap(3, ["python"]) == ["ip", "netns", "exec", "gvc1-n1", "python"]
    assert "2 node namespaces of 2 workers" in net.description
    assert "veth pair" in net.description
    assert net.created == []  # nothing is made before the `with` block


def test_without_nodes_every_worker_has_a_namespace_of_its_own() -> None:
    net = netns.ShapedNetwork(3, RATE, name_prefix="gvc1-")
    assert [net.namespace(net.node(r)) for r in range(3)] == ["gvc1-n0", "gvc1-n1", "gvc1-n2"]
    assert [net.address(r) for r in range(3)] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert net.description.startswith("network namespaces joined by veth links to a bridge")


@pytest.mark.parametrize(
    ("world_size", "ranks_per_node", "message"),
    [
        (4, 3, "ranks_per_node must be an integer >= 1 dividing the 4 workers, got 3"),
        (4, 0, "ranks_per_node must be an integer >= 1 dividing the 4 workers, got 0"),
        (4, 4, "a shaped network needs 2 to 254 nodes"),
        (255, 1, "a shaped network needs 2 to 254 nodes"),
    ],
)
def test_shaped_network_refuses_a_layout_it_cannot_make(
    world_size: int, ranks_per_node: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        netns.ShapedNetwork(world_size, RATE, name_prefix="gvc1-", ranks_per_node=ranks_per_node)


def test_loopback_measures_no_inter_node_bytes() -> None:
    assert netns.Loopback().tx_bytes() is None


def test_a_variant_passes_ranks_per_node_that_divides_the_workers() -> None:
    cfg = CompareConfig(modes=("gravac",), workers=4, nodes=2, workload="tiny-digits")
    two = parse_variant('two=topk:fixed{"cf": 100}:{"ranks_per_node": 2}')
    job = Study(cfg, (two,)).jobs()[0]
    assert job.config.engine_options == {"ranks_per_node": 2}
    three = parse_variant('three=topk:fixed{"cf": 100}:{"ranks_per_node": 3}')
    with pytest.raises(ValueError, match="ranks_per_node 3 must divide the 4 workers"):
        Study(cfg, (three,))
    with pytest.raises(ValueError, match="ranks_per_node"):
        parse_variant('zero=topk:fixed{"cf": 100}:{"ranks_per_node": 0}')


def _summary(*, nodes: int, shaped: bool) -> dict[str, Any]:
    """The made-up study's summary run on ``nodes`` nodes of 2, its runs having sent 8,000
    bytes between nodes in their 4 steps where ``shaped``."""
    sent = 8000 if shaped else None
    cfg = replace(made_up.CONFIG, workers=2 * nodes, nodes=nodes)
    runs = [replace(r, internode_bytes=sent, internode_bytes_per_step=sent and sent / 4)
            for r in made_up.runs()]  # fmt: skip
    summary = made_up.summary(runs)
    summary["layout"] = cfg.layout.to_dict()
    summary["network"]["shaped"] = shaped
    return summary


def _header(table: str) -> str:
    return next(line for line in table.splitlines() if line.startswith("| mode |"))


def test_table_has_the_inter_node_column_with_nodes_on_shaped_links() -> None:
    table = format_table(_summary(nodes=2, shaped=True))
    header = _header(table)
    assert "| reduction | inter-node MB/step | MB sent |" in header
    rows = [line for line in table.splitlines() if line.startswith("| ddp |")]
    assert "| 0.002 |" in rows[0]  # 8,000 bytes over 4 steps
    columns = header.count("|")
    assert all(line.count("|") == columns for line in table.splitlines() if line.startswith("|"))
    assert "- nodes: 2 nodes x 2 workers (ranks 0-1, 2-3); a node's workers share" in table
    assert "inter-node MB/step: what the links between the nodes' namespaces sent" in table


@pytest.mark.parametrize(("nodes", "shaped"), [(1, True), (2, False)])
def test_table_has_no_inter_node_column_on_one_node_or_loopback(nodes: int, shaped: bool) -> None:
    table = format_table(_summary(nodes=nodes, shaped=shaped))
    assert "inter-node" not in _header(table)
    assert ("- nodes:" in table) == (nodes > 1)


def test_summarise_divides_the_inter_node_bytes_by_the_steps_trained() -> None:
    cfg = CompareConfig(modes=("ddp",), steps=4, timing_warmup=1)
    raw = {
        "step_seconds": [1.0] * 4,
        "forward_backward_seconds": [0.5] * 4,
        "compute_seconds": [0.25],
        "wire_bytes": [400] * 4,
        "compress_seconds": [None] * 4,
        "comm_seconds": [None] * 4,
        "cf_sent": [None] * 4,
        "cf_achieved": [None] * 4,
        "evaluations": [[4, 4.0, 0.5]],
        "parameters": 100,
        "options": {},
    }
    ddp = summarise(modes.get("ddp"), cfg, raw, internode_bytes=6000)
    assert (ddp.internode_bytes, ddp.internode_bytes_per_step) == (6000, 1500.0)
    assert summarise(modes.get("ddp"), cfg, raw).internode_bytes_per_step is None

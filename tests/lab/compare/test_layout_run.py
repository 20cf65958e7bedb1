"""``gravac compare --nodes 2 --ranks-per-node 2`` on shaped links, end to end (root only): two
node namespaces of two workers, the inter-node bytes measured, every namespace removed."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gravac.cli import main
from gravac_lab.compare import modes, netns
from tests.lab.compare.namespaces import UNAVAILABLE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs shaped links: {UNAVAILABLE}"),
]

NODES, RANKS_PER_NODE = 2, 2
#: steps of the run: a few seconds of training per mode
STEPS = 6
#: a ring all-reduce's workers each send ``2 (n - 1) / n`` of the gradient's bytes a step; in
#: the flat layout every one of the 4 crosses a shaped link (6x the gradient in all), in 2
#: nodes of 2 half the ring lies inside the nodes (3x). Above this share the workers of a node
#: would be talking over its link, not over its own address.
MAX_DDP_SHARE = 4.5


def test_two_nodes_of_two_workers_on_shaped_links(tmp_path: Path) -> None:
    # no link test: its 4 workers would only cost time (test_netns.py measures a link)
    out = tmp_path / "nodes.json"
    argv = ["compare", "--quick", "--nodes", str(NODES), "--ranks-per-node", str(RANKS_PER_NODE),
            "--bandwidth", "1gbit", "--modes", "ddp,gravac", "--steps", str(STEPS),
            "--timing-warmup", "1", "--eval-every", "3", "--link-test-mb", "0", "--policy", "fixed",
            "--policy-options", '{"cf": 100}', "--out", str(out)]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    assert netns.list_namespaces(netns.prefix()) == []  # every gvc namespace of this run is gone
    summary = json.loads(out.read_text())
    assert summary["layout"]["nodes"] == NODES
    assert summary["layout"]["world_size"] == summary["config"]["workers"] == 4
    assert summary["network"]["shaped"] is True
    assert "2 node namespaces of 2 workers" in summary["network"]["description"]
    by_mode = {r["mode"]: r for r in summary["runs"]}
    assert set(by_mode) == {"ddp", "gravac"}
    for run in by_mode.values():
        assert run["steps"] == STEPS
        assert run["internode_bytes"] > 0
        assert run["internode_bytes_per_step"] == run["internode_bytes"] / STEPS
    # every rank's result was read, and all 4 sent at the CF rank 0 sent at
    assert by_mode["gravac"]["ranks_agree"] is True
    assert by_mode["gravac"]["cf_sent_by_step"] == [100.0] * STEPS
    ddp = by_mode["ddp"]
    assert ddp["internode_bytes_per_step"] < MAX_DDP_SHARE * ddp["dense_wire_bytes_per_step"]
    # gravac found the nodes in torchrun's variables
    assert by_mode["gravac"]["options"][modes.RANKS_PER_NODE] == RANKS_PER_NODE
    # the node's workers share a host: the default moved the node's stages through its memory
    assert by_mode["gravac"]["options"][modes.NODE_STAGE] == "shm"
    assert by_mode["gravac"]["options"]["topology"] == "2 node(s) of 2 ranks, node stage shm"
    table = stdout.getvalue()
    header = next(line for line in table.splitlines() if line.startswith("| mode |"))
    assert "| inter-node MB/step |" in header
    column = header.split("|").index(" inter-node MB/step ")
    for line in table.splitlines():
        if line.startswith(("| ddp |", "| gravac |")):
            assert float(line.split("|")[column]) > 0

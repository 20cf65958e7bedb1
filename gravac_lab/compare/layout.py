"""How ``gravac compare``'s workers are grouped into nodes: ``--nodes`` x ``--ranks-per-node``.

A :class:`NodeLayout` is ``nodes`` nodes of ``ranks_per_node`` consecutive ranks each, as
torchrun numbers them on a cluster: global rank ``n * L + l`` is local rank ``l`` of node ``n``.
On one machine the nodes are emulated (:mod:`gravac_lab.compare.netns`): with shaped links the
ranks of a node share one network namespace, so that their mutual traffic stays on the node's
own addresses (unshaped, as inside a machine), while the links between the nodes' namespaces are
shaped; every worker also gets the variables torchrun sets for its node
(:meth:`NodeLayout.torchrun_env`), from which gravac's ``ranks_per_node=None`` finds the nodes.

One node (the default) is the flat layout every run had before nodes: every worker is a host of
its own, each behind a shaped link of its own when links are shaped
(:attr:`NodeLayout.ranks_per_host` is 1), and no torchrun variables are set.

:meth:`NodeLayout.of_options` reads the three options that define a layout, ``--workers``,
``--nodes`` and ``--ranks-per-node``, any two of which fix the third.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_WORKERS", "MIN_WORKERS", "NodeLayout", "check_count"]

#: workers of a run that names none of ``--workers``, ``--nodes``, ``--ranks-per-node``
DEFAULT_WORKERS = 2
#: the fewest workers a run trains with: one worker has no one to communicate with
MIN_WORKERS = 2


def check_count(option: str, value: object, *, text: str | None = None) -> int:
    """``value`` if it is an integer >= 1 (the count ``option`` gives; ``text``: as written on
    the command line).

    Raises:
        ValueError: naming ``option``, the value (``text`` if given) and what is allowed.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        shown = repr(value if text is None else text)
        raise ValueError(f"{option} must be an integer >= 1, got {shown}")
    return value


def _share(workers: int, option: str, count: int) -> int:
    """``workers`` divided by ``count`` (what ``option`` gives).

    Raises:
        ValueError: ``count`` does not divide ``workers``; naming both options and values.
    """
    if workers % count:
        raise ValueError(
            f"--workers {workers} is not a multiple of {option} {count} (every node has as "
            "many workers)"
        )
    return workers // count


@dataclass(frozen=True)
class NodeLayout:
    """``nodes`` nodes of ``ranks_per_node`` consecutive ranks (see the module docstring).

    Raises:
        ValueError: a count that is not an integer >= 1, naming its option.
    """

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        check_count("--nodes", self.nodes)
        check_count("--ranks-per-node", self.ranks_per_node)

    @classmethod
    def of_options(
        cls, *, workers: int | None, nodes: int | None, ranks_per_node: int | None
    ) -> NodeLayout:
        """The layout of the options given (``None``: not given).

        ``--nodes`` and ``--ranks-per-node`` together make the workers (``--workers``, if given
        too, must agree); one of them with ``--workers`` makes the other (it must divide the
        workers); ``--nodes`` alone is nodes of one worker, ``--ranks-per-node`` alone one node;
        ``--workers`` alone, or nothing, one node of :data:`DEFAULT_WORKERS`.

        Raises:
            ValueError: a count that is not an integer >= 1, counts that disagree, or fewer than
                :data:`MIN_WORKERS` workers; the message names the options and their values.
        """
        options = {"--workers": workers, "--nodes": nodes, "--ranks-per-node": ranks_per_node}
        given = {o: check_count(o, v) for o, v in options.items() if v is not None}
        if nodes is not None and ranks_per_node is not None:
            if workers is not None and workers != nodes * ranks_per_node:
                raise ValueError(
                    f"--workers {workers} disagrees with --nodes {nodes} x --ranks-per-node "
                    f"{ranks_per_node} = {nodes * ranks_per_node} workers; leave --workers out "
                    "or make it their product"
                )
            layout = cls(nodes, ranks_per_node)
        elif nodes is not None:
            per_node = 1 if workers is None else _share(workers, "--nodes", nodes)
            layout = cls(nodes, per_node)
        elif ranks_per_node is not None:
            count = 1 if workers is None else _share(workers, "--ranks-per-node", ranks_per_node)
            layout = cls(count, ranks_per_node)
        else:
            layout = cls(1, DEFAULT_WORKERS if workers is None else workers)
        if layout.world_size < MIN_WORKERS:
            named = " ".join(f"{o} {v}" for o, v in given.items())
            raise ValueError(
                f"{named}: {layout.world_size} worker in all; a run needs "
                f"{MIN_WORKERS} or more (--workers must be an integer >= {MIN_WORKERS})"
            )
        return layout

    @property
    def world_size(self) -> int:
        """Workers in all."""
        return self.nodes * self.ranks_per_node

    @property
    def grouped(self) -> bool:
        """Whether there is more than one node (else the flat layout of every run before)."""
        return self.nodes > 1

    @property
    def ranks_per_host(self) -> int:
        """Ranks that share a network namespace when links are shaped: a node's, or 1 with
        a single node (every worker behind a link of its own, as before nodes)."""
        return self.ranks_per_node if self.grouped else 1

    def node(self, rank: int) -> int:
        """The node of global rank ``rank``."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index in its node."""
        return rank % self.ranks_per_node

    def ranks(self, node: int) -> range:
        """The global ranks of ``node``."""
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def torchrun_env(self, rank: int) -> dict[str, str]:
        """The variables torchrun would set for worker ``rank`` on its node (none with a single
        node: every run before nodes ran without them)."""
        if not self.grouped:
            return {}
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank(rank)),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(self.node(rank)),
            "GROUP_WORLD_SIZE": str(self.nodes),
        }

    def describe(self) -> str:
        """One line for the report: ``2 nodes x 2 workers (ranks 0-1, 2-3)``."""
        if not self.grouped:
            return f"1 node of {self.world_size} workers (flat)"
        spans = ", ".join(
            f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
            for r in map(self.ranks, range(self.nodes))
        )
        workers = "worker" if self.ranks_per_node == 1 else "workers"
        return f"{self.nodes} nodes x {self.ranks_per_node} {workers} (ranks {spans})"

    def to_dict(self) -> dict[str, Any]:
        """The layout for the JSON report."""
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.world_size,
            "description": self.describe(),
        }

"""Registering the hook on a framework's DDP model: what both callbacks share."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac.ddp import GravacHookState, gravac_hook

__all__ = ["HookRegistrar"]


class HookRegistrar:
    """Registers :func:`gravac_hook` with one state on the DDP models a framework trains, once
    per model: a second ``fit`` or ``train`` on the same wrapper must not register again (DDP
    refuses a second hook).

    Args:
        state: the hook state.
        framework: named in the messages.
    """

    def __init__(self, state: GravacHookState, framework: str) -> None:
        if not isinstance(state, GravacHookState):
            raise TypeError(f"state must be a gravac.ddp.GravacHookState, got {state!r}")
        self.state = state
        self.framework = framework
        self._done: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models registered on

    def register(self, model: nn.Module | None, world_size: int) -> bool:
        """Register the hook on ``model``, the outermost model the framework trains (its DDP
        wrapper when distributed); ``world_size`` processes train.

        Returns:
            Whether the hook is now registered on ``model`` (not with a single process, which
            has nothing to communicate: a warning says so).

        Raises:
            RuntimeError: several processes train but ``model`` is not a
                ``DistributedDataParallel`` (FSDP, DeepSpeed, ... have no DDP comm hooks).
        """
        if not isinstance(model, DistributedDataParallel):
            if world_size > 1:
                raise RuntimeError(
                    f"gravac's hook needs {self.framework} to train a DistributedDataParallel "
                    f"model, but it trains {type(model).__name__} on {world_size} processes: "
                    "use plain DDP (not FSDP, DeepSpeed or model parallelism)"
                )
            warnings.warn(
                f"{self.framework} trains on one process: no gradient is communicated, so "
                "gravac's hook is not registered",
                stacklevel=3,
            )
            return False
        if model not in self._done:
            model.register_comm_hook(self.state, gravac_hook)
            self._done.add(model)
        return True

    # The models registered on belong to this process: a pickled copy (Lightning's ddp_spawn
    # sends the callbacks to new processes) starts without them.
    def __getstate__(self) -> dict[str, Any]:
        return {"state": self.state, "framework": self.framework}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(saved["state"], saved["framework"])  # type: ignore[misc]

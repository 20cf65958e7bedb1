"""gravac in PyTorch Lightning: a callback that registers the hook on the DDP model.

    state = GravacHookState(compressor="topk", policy="exponential", batch_size=32)
    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", callbacks=[GravacCallback(state)]
    )

.. note::
    ``DDPStrategy(ddp_comm_hook=gravac_hook, ddp_comm_state=state)`` registers the hook on CUDA
    only: Lightning's ``DDPStrategy._register_ddp_hooks`` skips every other device (its comment
    dates from PyTorch 1.8, when comm hooks needed NCCL), so on CPU (gloo) training silently
    runs uncompressed. The callback registers it on any device, in ``on_fit_start``: after the
    strategy wrapped the model, before the first backward. Use one or the other: DDP refuses a
    second hook. With ``strategy="ddp_spawn"`` the callback (and its state) is pickled into the
    spawned processes, which train with their copies: the launching process's state stays as
    it was (``strategy="ddp"`` runs the script in every process, and each keeps its own).

Checkpoints: Lightning writes rank 0's checkpoint, but the residuals are per rank, so the
callback's :meth:`~GravacCallback.state_dict` gathers every rank's hook state to rank 0 (on CPU)
and each rank loads its own on resume: a resumed run continues bit for bit. Resumed on another
number of processes, every rank loads the mean of the saved residuals (what they would have
added to the mean aggregate together), with a warning. With ``every_rank=False`` (or from an
older gravac) a checkpoint holds rank 0's state alone, which every rank loads, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from gravac.ddp import GravacHookState
from gravac.integrations._ranks import load_mean, on_cpu
from gravac.integrations._register import HookRegistrar

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as exc:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "gravac.integrations.lightning needs lightning: pip install 'gravac[integrations]'"
    ) from exc

__all__ = ["GravacCallback"]

#: the keys of the callback's state: the number of processes that saved it, and each one's hook
#: state in rank order (rank 0's alone holds them: the others' are not written)
_WORLD, _RANKS = "world_size", "ranks"


class GravacCallback(Callback):
    """Compress the gradients of Lightning's DDP training with gravac.

    Args:
        state: the hook state (its engine holds ``steps``, ``last_record``,
            ``total_wire_bytes`` ...).
        close_on_end: flush and close the state's monitor when ``fit`` ends.
        every_rank: keep every rank's hook state in the checkpoint (a resume is exact; rank 0
            holds every rank's residuals on CPU while it saves); ``False`` keeps rank 0's
            alone, which every rank loads on resume (its residuals stand in for the others'
            once), for a model whose residuals times the world size do not fit rank 0's
            memory.
    """

    def __init__(
        self, state: GravacHookState, *, close_on_end: bool = True, every_rank: bool = True
    ) -> None:
        if not isinstance(every_rank, bool):
            raise TypeError(f"every_rank must be True or False, got {every_rank!r}")
        self._hook = HookRegistrar(state, "Lightning")
        self.state = state
        self.close_on_end = close_on_end
        self.every_rank = every_rank

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._hook.register(trainer.strategy.model, trainer.world_size)
        if trainer.optimizers:  # its learning rate: the accordion policy reacts to decays
            self.state.watch(trainer.optimizers[0])

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.close_on_end:
            self.state.close()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's hook state, gathered to rank 0 on CPU, in rank order (Lightning calls
        it on every rank, as ``Trainer.save_checkpoint`` must be called, and writes rank 0's):
        ``{"world_size": W, "ranks": [state of rank 0, ..., of rank W-1]}``, ``"ranks"``
        ``None`` on the other ranks. Rank 0 holds every rank's residuals while it saves. With
        ``every_rank=False``, this rank's hook state alone."""
        if not self.every_rank:
            return self.state.state_dict()
        own = on_cpu(self.state.state_dict())
        group = self.state.process_group
        if not _distributed():
            return {_WORLD: 1, _RANKS: [own]}
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        root = 0 if group is None else dist.get_global_rank(group, 0)
        dist.gather_object(own, gathered, dst=root, group=group)
        return {_WORLD: world, _RANKS: gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's hook state from :meth:`state_dict`'s; on another number of
        processes, every rank takes the mean of the saved residuals (with a warning).

        Lightning restores after starting the process group but before the first step: the
        engine joins the group first, so that the loaded counters are not taken for steps
        made as a single worker (and the world size is compared with the group's).

        Raises:
            ValueError: the state holds no rank's hook state (a checkpoint not written by
                rank 0), or fewer states than the processes that saved it.
        """
        self.state.engine.join_group()
        if _RANKS not in state_dict:  # rank 0's state alone: every_rank=False, or older gravac
            warnings.warn(
                "the checkpoint holds one rank's gravac hook state (saved with every_rank=False "
                "or by an older gravac): every rank loads it, its residuals standing in for the "
                "others' once",
                stacklevel=2,
            )
            self.state.load_state_dict(state_dict)
            return
        saved_world, states = state_dict[_WORLD], state_dict[_RANKS]
        if states is None or len(states) != saved_world:
            held = "no" if states is None else len(states)
            raise ValueError(
                f"the checkpoint's gravac state holds {held} ranks' hook states for "
                f"world_size={saved_world} processes: load the checkpoint rank 0 wrote (it "
                "holds every rank's)"
            )
        group = self.state.process_group
        world = dist.get_world_size(group) if _distributed() else 1
        if world == saved_world:
            rank = dist.get_rank(group) if _distributed() else 0
            self.state.load_state_dict(states[rank])
            return
        load_mean(self.state, states, world, "the checkpoint's gravac state")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()

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
"""

from __future__ import annotations

from typing import Any

from gravac.ddp import GravacHookState
from gravac.integrations._register import HookRegistrar

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as exc:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "gravac.integrations.lightning needs lightning: pip install 'gravac[integrations]'"
    ) from exc

__all__ = ["GravacCallback"]


class GravacCallback(Callback):
    """Compress the gradients of Lightning's DDP training with gravac.

    Args:
        state: the hook state (its engine holds ``steps``, ``last_record``,
            ``total_wire_bytes`` ...).
        close_on_end: flush and close the state's monitor when ``fit`` ends.
    """

    def __init__(self, state: GravacHookState, *, close_on_end: bool = True) -> None:
        self._hook = HookRegistrar(state, "Lightning")
        self.state = state
        self.close_on_end = close_on_end

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._hook.register(trainer.strategy.model, trainer.world_size)
        if trainer.optimizers:  # its learning rate: the accordion policy reacts to decays
            self.state.watch(trainer.optimizers[0])

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.close_on_end:
            self.state.close()

    def state_dict(self) -> dict[str, Any]:
        """The hook state (Lightning's checkpoints keep rank 0's)."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the hook state (rank 0's residuals on every rank: a one-off perturbation).

        Lightning restores after starting the process group but before the first step: the
        engine joins the group first, so that the loaded counters are not taken for steps
        made as a single worker (and the world size is compared with the group's).
        """
        self.state.engine.join_group()
        self.state.load_state_dict(state_dict)

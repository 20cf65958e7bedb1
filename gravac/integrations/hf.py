"""gravac in the Hugging Face ``Trainer``: a callback that registers the hook on the model the
``Trainer`` wrapped in ``DistributedDataParallel``.

    state = GravacHookState(compressor="topk", policy="exponential", batch_size=32)
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(GravacCallback(state, trainer))
    trainer.train()              # torchrun --nproc-per-node 2 script.py

.. note::
    The callback takes the ``Trainer`` because a callback cannot reach the DDP model
    otherwise: the ``Trainer`` (through accelerate) wraps the model in ``train()``, keeps the
    wrapper in ``trainer.model_wrapped``, and hands callbacks only ``trainer.model``, the
    unwrapped one. ``on_train_begin`` runs after the wrapping and before the first backward,
    so it registers the hook there (once per wrapper: a second ``train()`` reuses it).
    accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only PyTorch's
    built-in hooks. The state is created before or after ``TrainingArguments`` (which starts
    the process group under torchrun): the hook joins the group at its first step.
"""

from __future__ import annotations

from typing import Any

from gravac.ddp import GravacHookState
from gravac.integrations._register import HookRegistrar

try:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
except ImportError as exc:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "gravac.integrations.hf needs transformers: pip install 'gravac[integrations]'"
    ) from exc

__all__ = ["GravacCallback"]


class GravacCallback(TrainerCallback):
    """Compress the gradients of the ``Trainer``'s DDP training with gravac.

    Args:
        state: the hook state (its engine holds ``steps``, ``last_record``,
            ``total_wire_bytes`` ...).
        trainer: the ``Trainer`` this callback is added to (``trainer.add_callback(...)``).
        close_on_end: flush and close the state's monitor when ``train()`` ends.
    """

    def __init__(
        self, state: GravacHookState, trainer: Trainer, *, close_on_end: bool = True
    ) -> None:
        self._hook = HookRegistrar(state, "the Trainer")
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {trainer!r}")
        self.state = state
        self.trainer = trainer
        self.close_on_end = close_on_end

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model = kwargs.get("model")
        if model is not None and model is not self.trainer.model:
            raise RuntimeError(
                "GravacCallback was added to another Trainer than the one it was given: "
                "use trainer.add_callback(GravacCallback(state, trainer))"
            )
        self._hook.register(self.trainer.model_wrapped, args.world_size)
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:  # its learning rate: the accordion policy reacts to decays
            self.state.watch(optimizer)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.close_on_end:
            self.state.close()

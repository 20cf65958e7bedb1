"""gravac in the Hugging Face ``Trainer``: a callback that registers the hook on the model the
``Trainer`` wrapped in ``DistributedDataParallel``, and saves and restores the hook's state
with the ``Trainer``'s checkpoints.

    state = GravacHookState(compressor="topk", policy="exponential", batch_size=32)
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(GravacCallback(state, trainer))
    trainer.train()              # torchrun --nproc-per-node 2 script.py
    trainer.train(resume_from_checkpoint=True)      # after a restart: gravac resumes too

Checkpoints: at each of the ``Trainer``'s saves, every rank writes its hook state
(:meth:`GravacHookState.state_dict`: the engine's step count, search state and the rank's own
residuals) to ``gravac-rank{R}.pt`` in the checkpoint folder, as ``{"hook": ...,
"world_size": ...}`` (``torch.load(..., weights_only=True)`` reads it). When ``train`` resumes
from a checkpoint (a path, or ``True``: the last one in ``output_dir``), each rank loads its
file before the first step, so that the engine continues at the checkpoint's step with its
residuals. A checkpoint saved by another number of processes gives every rank the mean of the
saved residuals, with a warning (residuals are per rank: :mod:`gravac.integrations._ranks`); one
that lacks some rank's file raises; one with no gravac state at all (saved without this
callback) warns and gravac starts afresh: a warning, not an error, so that a run may turn
gravac on from a checkpoint of dense training.
Resume in a new ``Trainer``, as a restarted job does: residuals are matched to parameters by
DDP's initial buckets. ``hyperparameter_search``'s trial folders are not covered.

.. note::
    The callback takes the ``Trainer`` because a callback cannot reach the DDP model
    otherwise: the ``Trainer`` (through accelerate) wraps the model in ``train()``, keeps the
    wrapper in ``trainer.model_wrapped``, and hands callbacks only ``trainer.model``, the
    unwrapped one. ``on_train_begin`` runs after the wrapping and before the first backward,
    so it registers the hook there (once per wrapper: a second ``train()`` reuses it).
    accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only PyTorch's
    built-in hooks. The state is created before or after ``TrainingArguments`` (which starts
    the process group under torchrun): the hook joins the group at its first step. Nor do
    callbacks learn which checkpoint ``train`` resumes from (the ``Trainer`` keeps it in a
    local variable, and ``args.resume_from_checkpoint`` is only for scripts to read): the
    callback wraps ``trainer.train`` to note it.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from gravac.ddp import GravacHookState
from gravac.integrations._ranks import load_mean
from gravac.integrations._register import HookRegistrar

try:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as exc:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "gravac.integrations.hf needs transformers: pip install 'gravac[integrations]'"
    ) from exc

__all__ = ["STATE_FILE", "GravacCallback"]

#: the file each rank's hook state is saved to in a checkpoint folder (``{rank}``: its
#: ``args.process_index``)
STATE_FILE = "gravac-rank{rank}.pt"
_STATE_FILE_RE = re.compile(r"^gravac-rank(\d+)\.pt$")
_GLOB = STATE_FILE.format(rank="*")


def _state_file(checkpoint: str, rank: int) -> str:
    """The path of ``rank``'s hook state in the ``checkpoint`` folder."""
    return os.path.join(checkpoint, STATE_FILE.format(rank=rank))


def _load(path: str) -> dict[str, Any]:
    """A state file :meth:`GravacCallback.on_save` wrote.

    Raises:
        ValueError: it lacks the hook state or the world size.
    """
    saved: dict[str, Any] = torch.load(path, weights_only=True)
    missing = [k for k in ("hook", "world_size") if k not in saved]
    if missing:
        raise ValueError(f"{path} is not a GravacCallback checkpoint: missing {missing}")
    return saved


class GravacCallback(TrainerCallback):
    """Compress the gradients of the ``Trainer``'s DDP training with gravac; save the hook
    state with the ``Trainer``'s checkpoints and restore it when ``train`` resumes from one.

    Args:
        state: the hook state (its engine holds ``steps``, ``last_record``,
            ``total_wire_bytes`` ...).
        trainer: the ``Trainer`` this callback is added to (``trainer.add_callback(...)``);
            its ``train`` is wrapped to note the checkpoint it resumes from.
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
        self._resuming: str | None = None  # the checkpoint folder the running train() loads
        trainer.train = self._noting_resume(trainer.train)  # type: ignore[method-assign]

    def _noting_resume(self, train: Callable[..., Any]) -> Callable[..., Any]:
        """``train``, noting the checkpoint folder it resumes from as the ``Trainer`` resolves
        it (``True``: the last checkpoint in ``output_dir``) while it runs."""

        @functools.wraps(train)
        def train_noting_resume(
            resume_from_checkpoint: str | os.PathLike[str] | bool | None = None,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            if resume_from_checkpoint is True:
                self._resuming = get_last_checkpoint(self.trainer.args.output_dir)
            elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
                self._resuming = os.fspath(resume_from_checkpoint)
            try:
                return train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._resuming = None

        return train_noting_resume

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
        if self._resuming is not None:
            self._restore(self._resuming, args.process_index, args.world_size)
        self._hook.register(self.trainer.model_wrapped, args.world_size)
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:  # its learning rate: the accordion policy reacts to decays
            self.state.watch(optimizer)

    def _restore(self, checkpoint: str, rank: int, world_size: int) -> None:
        """Load ``rank``'s hook state from the ``checkpoint`` folder, before the first step; the
        mean of every saved rank's residuals where another number of processes saved it.

        Raises:
            ValueError: a file is not a state this callback saved, or the checkpoint, saved by
                another number of processes, lacks some rank's file.
        """
        saved = sorted(
            int(m.group(1))
            for m in map(_STATE_FILE_RE.match, os.listdir(checkpoint))
            if m is not None
        )
        if not saved:
            warnings.warn(
                f"resume_from_checkpoint={checkpoint!r} holds no gravac hook state "
                f"({STATE_FILE.format(rank=rank)}): it was saved without GravacCallback, so "
                "gravac starts afresh (engine step 0, no residuals, the search from its warm-up)",
                stacklevel=2,
            )
            return
        # the world that saved it, as this rank's file says (else the first's)
        told = _load(_state_file(checkpoint, rank if rank in saved else saved[0]))
        saved_world = int(told["world_size"])
        missing = [r for r in range(saved_world) if r not in saved]
        if missing:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} holds gravac's hook state of ranks "
                f"{saved}, but world_size={saved_world} processes saved it: ranks {missing} "
                f"lack their {_GLOB} file (residuals are per rank); remove them all to start "
                "gravac afresh"
            )
        # the engine joins the group first: the loaded counters are not steps made alone
        self.state.engine.join_group()
        if saved_world == world_size:  # then no rank is missing: ``told`` is this rank's file
            self.state.load_state_dict(told["hook"])
            return
        files = [_load(_state_file(checkpoint, r)) for r in range(saved_world)]
        others = [r for r, f in enumerate(files) if f["world_size"] != saved_world]
        if others:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r}: the {_GLOB} files of ranks {others} "
                f"were saved by another number of processes than world_size={saved_world}"
            )
        states = [f["hook"] for f in files]
        load_mean(self.state, states, world_size, f"resume_from_checkpoint={checkpoint!r}")

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        assert args.output_dir is not None  # TrainingArguments sets its default
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)  # the Trainer's main process may not have made it
        path = _state_file(folder, args.process_index)
        saved = {"hook": self.state.state_dict(), "world_size": args.world_size}
        torch.save(saved, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # never half a file under the name a resume reads

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.close_on_end:
            self.state.close()

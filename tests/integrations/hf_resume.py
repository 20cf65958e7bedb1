"""The Hugging Face ``Trainer`` with :class:`~gravac.integrations.hf.GravacCallback`, trained
straight through and resumed from its middle checkpoint (read by ``test_hf.py``).

    torchrun --nproc-per-node 2 tests/integrations/hf_resume.py OUT

Run ``full`` trains :data:`STEPS` steps into ``OUT/full``, a checkpoint every
:data:`SAVE_EVERY`; run ``resumed``, a new model, hook state and ``Trainer`` in the same
processes, resumes from ``OUT/full/checkpoint-{SAVE_EVERY}`` into ``OUT/resumed``. After each
run every rank writes ``OUT/{run}-rank{R}.pt`` (:func:`report`). The hook state's clock is a
counter, so that the CF search decides the same in both runs (it ranks CFs by step times).
torchrun runs this file as a script: the repository's root goes on ``sys.path`` for ``tests``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no download

import itertools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import gravac
from gravac.ddp import GravacHookState
from gravac.integrations.hf import GravacCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import tiny_model  # the root is on sys.path only from here
from tests.integrations._run import rank_report

#: the Trainer's steps in each run; 4 samples a rank per step, 8 steps an epoch
STEPS = 6
#: steps between checkpoints: the resumed run starts from the first
SAVE_EVERY = 3
#: samples per rank per step
BATCH = 4


class Classifier(nn.Module):
    """The tests' tiny model (2-D, 4-D and 1-D parameters), returning the ``loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model(seed=0)

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


class Data(Dataset[dict[str, Tensor]]):
    """64 random images and labels, the same in every process."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 1, 8, 8, generator=gen)
        self.y = torch.randint(0, 10, (64,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def trainer(output_dir: Path) -> Trainer:
    """A ``Trainer`` of a new :class:`Classifier` (shuffled data, AdamW, linear decay) that
    checkpoints every :data:`SAVE_EVERY` steps into ``output_dir``."""
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        # DDP keeps its initial buckets (the Trainer's default here): with False it rebuilds
        # them after its first step, so the resumed run's first step would sum the search's
        # float32 statistics over other buckets than the run straight through does (in the
        # last bits; the residuals and parameters stay bit for bit the same)
        ddp_find_unused_parameters=True,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=Classifier(), args=args, train_dataset=Data())


def hook_state() -> GravacHookState:
    """Top-k under the default search, past its warm-up within the run, on a counter clock."""
    ticks = itertools.count()
    return GravacHookState(
        compressor="topk", window=2, warmup_steps=2, batch_size=BATCH, clock=lambda: next(ticks)
    )


def report(state: GravacHookState, model: nn.Module, run: Trainer) -> dict[str, Any]:
    """A rank's end of a run (:func:`tests.integrations._run.rank_report`)."""
    return rank_report(run.state.global_step, state.engine.steps, state.state_dict(), model)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)  # 2 processes on a small machine: one core each
    for name, resume in (("full", None), ("resumed", out / "full" / f"checkpoint-{SAVE_EVERY}")):
        run = trainer(out / name)
        state = hook_state()
        run.add_callback(GravacCallback(state, run))
        run.train(resume_from_checkpoint=None if resume is None else str(resume))
        rank = run.args.process_index
        torch.save(report(state, run.model, run), out / f"{name}-rank{rank}.pt")
        del run  # it holds the DDP model, which holds the process group
    gravac.release_group()  # free that and leave together (see gravac.launch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

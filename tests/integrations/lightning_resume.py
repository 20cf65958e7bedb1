"""PyTorch Lightning with :class:`~gravac.integrations.lightning.GravacCallback`, trained
straight through and resumed from its first epoch's checkpoint (read by ``test_lightning.py``).

    torchrun --nproc-per-node 2 tests/integrations/lightning_resume.py OUT

Run ``full`` trains :data:`EPOCHS` epochs of :data:`STEPS_AN_EPOCH` steps into ``OUT/full``, a
checkpoint at each epoch's end; run ``resumed``, a new module, hook state and ``Trainer`` in the
same processes, resumes from ``OUT/full/epoch=0.ckpt`` into ``OUT/resumed``. After each run
every rank writes ``OUT/{run}-rank{R}.pt`` (:func:`report`). The hook state's clock is a
counter, so that the CF search decides the same in both runs (it ranks CFs by step times).
torchrun runs this file as a script: the repository's root goes on ``sys.path`` for ``tests``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import gravac
from gravac.ddp import GravacHookState
from gravac.integrations.lightning import GravacCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import tiny_model  # the root is on sys.path only from here
from tests.integrations._run import rank_report

#: epochs in the run straight through; the resumed run starts after the first
EPOCHS = 2
#: samples per rank per step
BATCH = 4
#: steps an epoch: 2 ranks of BATCH samples each
STEPS_AN_EPOCH = 3
#: the checkpoint the resumed run starts from
FIRST = "epoch=0.ckpt"


class Classifier(pl.LightningModule):
    """The tests' tiny model (2-D, 4-D and 1-D parameters), SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model(seed=0)

    def training_step(self, b: tuple[Tensor, Tensor], i: int) -> Tensor:
        return nn.functional.cross_entropy(self.net(b[0]), b[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader[tuple[Tensor, ...]]:
    """Random images and labels, the same in every process, shuffled (Lightning's
    ``DistributedSampler`` splits them between the ranks, by epoch)."""
    gen = torch.Generator().manual_seed(0)
    n = 2 * BATCH * STEPS_AN_EPOCH
    data = TensorDataset(torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,)))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def trainer(folder: Path, state: GravacHookState) -> pl.Trainer:
    """2 CPU processes under DDP (gloo) with the callback, a checkpoint at each epoch's end."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        # DDP keeps its initial buckets: without unused parameters looked for it rebuilds them
        # after its first step, so the resumed run's first step would sum the search's float32
        # statistics over other buckets than the run straight through does (in the last bits)
        strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=True),
        max_epochs=EPOCHS,
        callbacks=[
            GravacCallback(state),
            ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, every_n_epochs=1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def hook_state() -> GravacHookState:
    """Top-k under the default search, past its warm-up within the run, on a counter clock."""
    ticks = itertools.count()
    return GravacHookState(
        compressor="topk", window=2, warmup_steps=2, batch_size=BATCH, clock=lambda: next(ticks)
    )


def report(state: GravacHookState, module: nn.Module, run: pl.Trainer) -> dict[str, Any]:
    """A rank's end of a run (:func:`tests.integrations._run.rank_report`)."""
    return rank_report(run.global_step, state.engine.steps, state.state_dict(), module)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)  # 2 processes on a small machine: one core each
    for name, resume in (("full", None), ("resumed", out / "full" / FIRST)):
        pl.seed_everything(0, verbose=False)
        state = hook_state()
        run, module = trainer(out / name, state), Classifier()
        run.fit(module, loader(), ckpt_path=None if resume is None else str(resume))
        torch.save(report(state, module, run), out / f"{name}-rank{run.global_rank}.pt")
        del run  # it holds the DDP model, which holds the process group
    gravac.release_group()  # free that and leave together (see gravac.launch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

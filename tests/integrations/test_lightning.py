"""PyTorch Lightning with gravac's callback: in this process and on a spawned gloo group (its
example, real DDP gloo processes that Lightning starts: ``test_examples.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac.ddp import GravacHookState, gravac_hook
from gravac.launch import free_port
from tests.helpers import batch, tiny_model
from tests.workers import Workers

pl = pytest.importorskip("lightning.pytorch")
from gravac.integrations.lightning import GravacCallback  # noqa: E402

pytestmark = pytest.mark.slow
SPAWN_TIMEOUT = 120.0


def test_one_process_trains_uncompressed_with_a_warning() -> None:
    x, y = batch(0, 0, size=32)
    state = GravacHookState(compressor="topk")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[GravacCallback(state)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="one process"):
        trainer.fit(Net(), loader)
    assert trainer.global_step == 2
    assert state.engine.steps == 0
    assert state.watched is trainer.optimizers[0]  # its learning rate reaches the engine


def restore_before_joining(rank: int, world_size: int, saved: dict[str, Any]) -> dict[str, Any]:
    """Lightning's resume order: the state is made before the process group exists, the
    checkpoint is loaded once it does, then training steps."""
    dist.destroy_process_group()
    state = GravacHookState(compressor="topk", window=3, warmup_steps=2)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    GravacCallback(state).load_state_dict(saved)
    net = DistributedDataParallel(tiny_model())
    net.register_comm_hook(state, gravac_hook)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(net(x), y).backward()
    return {"steps": state.engine.steps}


def save_after_steps(rank: int, world_size: int) -> dict[str, Any]:
    """The callback's state after 3 steps."""
    state = GravacHookState(compressor="topk", window=3, warmup_steps=2)
    net = DistributedDataParallel(tiny_model())
    net.register_comm_hook(state, gravac_hook)
    for step in range(3):
        net.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
    return GravacCallback(state).state_dict()


def test_a_checkpoint_is_restored_on_the_group_lightning_started(gloo_pools: Workers) -> None:
    [saved] = gloo_pools.run(save_after_steps, 1, timeout=SPAWN_TIMEOUT)
    assert saved["steps"] == 3
    [result] = gloo_pools.run(restore_before_joining, 1, saved, timeout=SPAWN_TIMEOUT)
    assert result["steps"] == 4

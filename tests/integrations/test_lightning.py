"""PyTorch Lightning with gravac's callback: in this process and on a spawned gloo group (its
example, real DDP gloo processes that Lightning starts: ``test_examples.py``), and its
checkpoints: ``lightning_resume.py`` under torchrun trains straight through and resumes
(``launches``: started with the session, tests/background.py), and the tests in this process
load its checkpoint as one process would."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac.ddp import GravacHookState, gravac_hook
from gravac.launch import free_port
from tests.background import Background
from tests.helpers import batch, tiny_model, torchrun_command
from tests.integrations._run import Run, assert_same, assert_two_ranks_mean, run_example
from tests.workers import Workers

pl = pytest.importorskip("lightning.pytorch")
from gravac.integrations.lightning import GravacCallback  # noqa: E402
from tests.integrations import lightning_resume  # noqa: E402

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
    assert saved["world_size"] == 1 and saved["ranks"][0]["steps"] == 3
    [result] = gloo_pools.run(restore_before_joining, 1, saved, timeout=SPAWN_TIMEOUT)
    assert result["steps"] == 4


# ------------------------------------------------------------------ checkpoints and resume
def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Run]]:
    """``resume``: ``lightning_resume.py`` under torchrun (2 gloo processes), when a selected
    test reads it (tests/background.py starts it with the session)."""
    if not any("resumed" in getattr(i, "fixturenames", ()) for i in items):
        return {}
    command = functools.partial(torchrun_command, Path(lightning_resume.__file__), str(tmp))
    return {"resume": functools.partial(run_example, command, tmp, {})}


@pytest.fixture(scope="module")
def resumed(background: Background, request: pytest.FixtureRequest) -> Path:
    """The folder of ``lightning_resume.py``'s runs, once it succeeded."""
    out, folder = background.results(request)["resume"]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return folder


def _saved(resumed: Path) -> dict[str, Any]:
    """The callback's state in the first epoch's checkpoint (rank 0 wrote it)."""
    checkpoint = torch.load(resumed / "full" / lightning_resume.FIRST, weights_only=True)
    [state] = [v for k, v in checkpoint["callbacks"].items() if k.startswith("GravacCallback")]
    return state


def test_a_run_resumed_from_its_epochs_checkpoint_ends_as_the_run_straight_through(
    resumed: Path,
) -> None:
    """2 ranks; the resumed run is a new module, hook state and ``Trainer`` loading the first
    epoch's checkpoint (the module, SGD's momenta, the loops: Lightning's; every rank's hook
    state: gravac's). Each rank ends bit for bit as it did straight through: the engine's step
    count, the whole hook state (its own residuals, the search's state, counters) and the
    parameters. Before every rank's state was kept, both ranks loaded rank 0's and differed."""
    steps = lightning_resume.EPOCHS * lightning_resume.STEPS_AN_EPOCH
    for rank in range(2):
        full, again = (
            torch.load(resumed / f"{run}-rank{rank}.pt", weights_only=True)
            for run in ("full", "resumed")
        )
        assert full["global_step"] == again["global_step"] == steps
        assert again["steps"] == full["steps"] == steps
        assert_same(full["hook"], again["hook"], f"rank {rank} hook")
        assert_same(full["params"], again["params"], f"rank {rank} params")
    saved = _saved(resumed)
    assert saved["world_size"] == 2
    states = saved["ranks"]
    assert [s["steps"] for s in states] == [lightning_resume.STEPS_AN_EPOCH] * 2
    assert not torch.equal(states[0]["residuals"][0], states[1]["residuals"][0])


def test_a_checkpoint_of_two_processes_resumes_on_one_with_the_mean_residuals(
    resumed: Path,
) -> None:
    saved = _saved(resumed)
    state = lightning_resume.hook_state()
    with pytest.warns(UserWarning, match="saved by world_size=2 processes, this run has"):
        GravacCallback(state).load_state_dict(saved)
    assert_two_ranks_mean(state.state_dict(), saved["ranks"], lightning_resume.STEPS_AN_EPOCH)


def test_a_checkpoint_of_rank_0s_state_alone_loads_on_every_rank_with_a_warning(
    resumed: Path,
) -> None:
    """What ``every_rank=False`` saves (and gravac did before every rank's state was kept):
    the rank's own hook state, which every rank loads."""
    rank0 = _saved(resumed)["ranks"][0]
    alone = GravacCallback(lightning_resume.hook_state(), every_rank=False)
    assert alone.state_dict().keys() == rank0.keys()
    state = lightning_resume.hook_state()
    with pytest.warns(UserWarning, match="holds one rank's gravac hook state"):
        GravacCallback(state).load_state_dict(rank0)
    assert_same(state.state_dict()["residuals"], rank0["residuals"])


def test_a_callback_state_without_the_ranks_states_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="every_rank must be True or False, got 'yes'"):
        GravacCallback(GravacHookState(), every_rank="yes")  # type: ignore[arg-type]
    state = GravacHookState(compressor="topk")
    with pytest.raises(ValueError, match="holds no ranks' hook states for world_size=2"):
        GravacCallback(state).load_state_dict({"world_size": 2, "ranks": None})
    assert state.engine.steps == 0

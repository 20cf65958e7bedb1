"""The Hugging Face Trainer with gravac's callback in this process (its example under torchrun,
real DDP gloo processes: ``test_examples.py``), and its checkpoints: ``hf_resume.py`` under
torchrun trains straight through and resumes (``launches``: started with the session, beside
the tests run in this process, tests/background.py), and the tests in this process resume from
its checkpoints on one process."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure of it

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from gravac.ddp import GravacHookState
from tests.background import Background
from tests.helpers import batch, tiny_model, torchrun_command
from tests.integrations._run import Run, assert_same, assert_two_ranks_mean, run_example

transformers = pytest.importorskip("transformers")
from gravac.integrations.hf import GravacCallback  # noqa: E402
from tests.integrations import hf_resume  # noqa: E402

pytestmark = pytest.mark.slow


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model()

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


class _Data(Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = batch(0, 0, size=32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _trainer(tmp_path: Path) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=8,
        max_steps=2,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return transformers.Trainer(model=_Classifier(), args=args, train_dataset=_Data())


def test_one_process_trains_uncompressed_with_a_warning(tmp_path: Path) -> None:
    state = GravacHookState(compressor="topk")
    trainer = _trainer(tmp_path)
    trainer.add_callback(GravacCallback(state, trainer))
    with pytest.warns(UserWarning, match="one process"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert state.engine.steps == 0
    assert state.watched is trainer.optimizer  # its learning rate reaches the engine


def test_a_callback_given_another_trainer_refuses_to_start(tmp_path: Path) -> None:
    state = GravacHookState(compressor="topk")
    trainer = _trainer(tmp_path)
    trainer.add_callback(GravacCallback(state, _trainer(tmp_path)))
    with pytest.raises(RuntimeError, match="another Trainer"):
        trainer.train()


def test_the_callback_checks_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="GravacHookState"):
        GravacCallback(object(), _trainer(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Trainer"):
        GravacCallback(GravacHookState(), object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ checkpoints and resume
#: the checkpoint ``hf_resume.py``'s second run resumes from, in its first run's folder
MIDDLE = f"checkpoint-{hf_resume.SAVE_EVERY}"


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Run]]:
    """``resume``: ``hf_resume.py`` under torchrun (2 gloo processes), when a selected test
    reads it (tests/background.py starts it with the session)."""
    if not any("resumed" in getattr(i, "fixturenames", ()) for i in items):
        return {}
    command = functools.partial(torchrun_command, Path(hf_resume.__file__), str(tmp))
    return {"resume": functools.partial(run_example, command, tmp, {"HF_HUB_OFFLINE": "1"})}


@pytest.fixture(scope="module")
def resumed(background: Background, request: pytest.FixtureRequest) -> Path:
    """The folder of ``hf_resume.py``'s runs, once it succeeded."""
    out, folder = background.results(request)["resume"]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "no gravac hook state" not in out.stderr
    return folder


def test_a_run_resumed_from_its_middle_checkpoint_ends_as_the_run_straight_through(
    resumed: Path,
) -> None:
    """2 ranks; the resumed run is a new model, hook state and ``Trainer`` loading
    :data:`MIDDLE` (the model, AdamW, its schedule, the data position and RNGs: the
    ``Trainer``'s; the hook state: gravac's). The hook's clock is a counter and DDP keeps its
    buckets (``hf_resume.trainer``), so every step is deterministic and each rank ends bit for
    bit as it did straight through: the engine's step count, the whole hook state (residuals,
    the search's state, counters) and the parameters."""
    for rank in range(2):
        full, again = (
            torch.load(resumed / f"{run}-rank{rank}.pt", weights_only=True)
            for run in ("full", "resumed")
        )
        assert full["global_step"] == again["global_step"] == hf_resume.STEPS
        assert again["steps"] == full["steps"] == hf_resume.STEPS
        assert_same(full["hook"], again["hook"], f"rank {rank} hook")
        assert_same(full["params"], again["params"], f"rank {rank} params")
    # what was resumed from: each rank's own state, loadable with weights_only
    saved = [
        torch.load(resumed / "full" / MIDDLE / f"gravac-rank{r}.pt", weights_only=True)
        for r in range(2)
    ]
    assert [s["world_size"] for s in saved] == [2, 2]
    assert [s["hook"]["steps"] for s in saved] == [hf_resume.SAVE_EVERY] * 2
    assert not torch.equal(saved[0]["hook"]["residuals"][0], saved[1]["hook"]["residuals"][0])


def _one_process_resume(checkpoint: Path, tmp_path: Path) -> transformers.Trainer:
    """A one-process ``Trainer`` of ``hf_resume``'s model with the callback, resuming from a
    copy of ``checkpoint`` in ``tmp_path`` (its ``output_dir``)."""
    shutil.copytree(checkpoint, tmp_path / checkpoint.name)
    trainer = hf_resume.trainer(tmp_path)
    trainer.add_callback(GravacCallback(hf_resume.hook_state(), trainer))
    return trainer


def test_a_checkpoint_of_two_processes_resumes_on_one_with_the_mean_residuals(
    resumed: Path, tmp_path: Path
) -> None:
    """One process (the hook is not registered: nothing steps it) loads the mean of the two
    saved ranks' residuals, which together still owe the mean aggregate what they did; a
    file of a third rank in the folder, which the saving run did not have, is not in it."""
    state = hf_resume.hook_state()
    shutil.copytree(resumed / "full" / MIDDLE, tmp_path / MIDDLE)
    # a stale file of a rank the saving run did not have is left out of the mean
    shutil.copy(tmp_path / MIDDLE / "gravac-rank1.pt", tmp_path / MIDDLE / "gravac-rank2.pt")
    trainer = hf_resume.trainer(tmp_path)
    trainer.add_callback(GravacCallback(state, trainer))
    with (
        pytest.warns(UserWarning, match="saved by world_size=2 processes, this run has world_siz"),
        pytest.warns(UserWarning, match="one process"),
    ):
        trainer.train(resume_from_checkpoint=str(tmp_path / MIDDLE))
    saved = [
        torch.load(resumed / "full" / MIDDLE / f"gravac-rank{r}.pt", weights_only=True)["hook"]
        for r in range(2)
    ]
    assert_two_ranks_mean(state.state_dict(), saved, hf_resume.SAVE_EVERY)


def test_a_checkpoint_without_some_ranks_state_refuses_to_resume(
    resumed: Path, tmp_path: Path
) -> None:
    trainer = _one_process_resume(resumed / "full" / MIDDLE, tmp_path)
    (tmp_path / MIDDLE / "gravac-rank0.pt").unlink()
    missing = r"ranks \[1\], but world_size=2 processes saved it: ranks \[0\] lack"
    with pytest.raises(ValueError, match=missing):
        trainer.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir


def test_a_rank_file_of_another_world_is_refused_by_name(resumed: Path, tmp_path: Path) -> None:
    trainer = _one_process_resume(resumed / "full" / MIDDLE, tmp_path)
    path = tmp_path / MIDDLE / "gravac-rank1.pt"
    torch.save({**torch.load(path, weights_only=True), "world_size": 3}, path)
    with pytest.raises(ValueError, match=r"files of ranks \[1\] were saved by another number"):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_without_gravac_state_resumes_with_a_warning(
    resumed: Path, tmp_path: Path
) -> None:
    trainer = _one_process_resume(resumed / "full" / MIDDLE, tmp_path)
    for rank in range(2):
        (tmp_path / MIDDLE / f"gravac-rank{rank}.pt").unlink()
    with (
        pytest.warns(UserWarning, match="holds no gravac hook state"),
        pytest.warns(UserWarning, match="one process"),
    ):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == hf_resume.STEPS
    # one process saves its own state
    saved = torch.load(
        tmp_path / f"checkpoint-{hf_resume.STEPS}" / "gravac-rank0.pt", weights_only=True
    )
    assert saved["world_size"] == 1

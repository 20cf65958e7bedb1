"""The Hugging Face Trainer with gravac's callback in this process (its example under torchrun,
real DDP gloo processes: ``test_examples.py``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure of it

from pathlib import Path

import pytest
from torch import Tensor, nn
from torch.utils.data import Dataset

from gravac.ddp import GravacHookState
from tests.helpers import batch, tiny_model

transformers = pytest.importorskip("transformers")
from gravac.integrations.hf import GravacCallback  # noqa: E402

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

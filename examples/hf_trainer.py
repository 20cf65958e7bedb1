"""GraVAC + Top-k under the Hugging Face ``Trainer``: scikit-learn's digits on 2 CPU processes.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --max-steps 300

torchrun starts the processes; the ``Trainer`` (through accelerate) creates the gloo process
group and wraps the model in ``DistributedDataParallel``, and gravac's
:class:`~gravac.integrations.hf.GravacCallback` registers the DDP communication hook on it. The
model is the demo's small CNN, defined here, returning a dict with ``loss`` as the ``Trainer``
expects: nothing is downloaded (``HF_HUB_OFFLINE=1``). Rank 0 prints the test accuracy, the CF
gravac sent at the last step and the bytes on the wire; ``--report DIR`` also writes each
rank's figures to ``DIR/rank{R}.json``. Needs ``pip install 'gravac[integrations,demo]'``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import gravac
from gravac.ddp import GravacHookState
from gravac.demo import DigitsCNN, digits_data
from gravac.integrations.hf import GravacCallback
from gravac.integrations.report import report_run


class DigitsClassifier(nn.Module):
    """The demo's CNN with the ``Trainer``'s interface: named inputs, a dict with ``loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DigitsCNN()

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        logits = self.net(pixel_values)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Digits(Dataset[dict[str, Tensor]]):
    """Images and labels as the ``Trainer``'s default collator stacks them."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compressor", default="topk", choices=gravac.compressors.names())
    parser.add_argument("--policy", default="exponential", choices=gravac.control.policies.names())
    parser.add_argument("--output-dir", default="runs/hf-trainer-digits")
    parser.add_argument("--log-dir", default=None, help="gravac's TensorBoard logs (rank 0)")
    parser.add_argument("--report", type=Path, default=None, help="write rank{R}.json here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # 2 processes on a small machine: one core each
    torch.manual_seed(0)  # the same start on every rank (DDP also broadcasts rank 0's)
    train_x, train_y, test_x, test_y = digits_data()
    model = DigitsClassifier()
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        per_device_train_batch_size=args.batch_size,
        dataloader_drop_last=True,
        max_steps=args.max_steps,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    state = GravacHookState(
        compressor=args.compressor,
        policy=args.policy,
        window=20,
        warmup_steps=40,
        ewma_alpha=0.2,
        batch_size=args.batch_size,
        monitor=args.log_dir,
    )
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Digits(train_x, train_y),
        optimizers=(sgd, None),
    )
    trainer.add_callback(GravacCallback(state, trainer))
    trainer.train()

    model.eval()
    with torch.no_grad():
        pred = model(test_x)["logits"].argmax(dim=1)
    accuracy = float((pred == test_y).float().mean())
    report_run(
        state.engine,
        model,
        rank=training.process_index,
        world_size=training.world_size,
        accuracy=accuracy,
        report_dir=args.report,
    )
    if dist.is_initialized():
        del trainer  # it holds the DDP model, which holds the process group
        gravac.release_group()  # free that and leave together (see gravac.launch)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

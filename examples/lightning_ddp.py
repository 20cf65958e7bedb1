"""GraVAC + Top-k under PyTorch Lightning: scikit-learn's digits on 2 CPU processes (DDP, gloo).

    python examples/lightning_ddp.py --max-steps 300

Lightning starts the second process itself (``accelerator="cpu", devices=2``, DDP). gravac's
:class:`~gravac.integrations.lightning.GravacCallback` registers the DDP communication hook
(on CPU, ``DDPStrategy(ddp_comm_hook=...)`` alone would be ignored by Lightning). Rank 0 prints
the test accuracy, the CF gravac sent at the last step and the bytes on the wire;
``--report DIR`` also writes each rank's figures to ``DIR/rank{R}.json``. With
``--precision 16-mixed`` it trains under float16 autocast with a loss scale, through
Lightning's ``MixedPrecision`` plugin given :class:`gravac.amp.GradScaler`, which keeps the
hook's residuals in the scale's unit when the scale changes. Needs
``pip install 'gravac[integrations,demo]'``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import gravac
from gravac.ddp import GravacHookState
from gravac.demo import DigitsCNN, digits_data
from gravac.integrations.lightning import GravacCallback
from gravac.integrations.report import report_run

#: processes Lightning starts on this machine
DEVICES = 2


class Digits(LightningModule):
    """The demo's CNN, trained with SGD + momentum."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = DigitsCNN()
        self.lr = lr

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compressor", default="topk", choices=gravac.compressors.names())
    parser.add_argument("--policy", default="exponential", choices=gravac.control.policies.names())
    parser.add_argument("--log-dir", default=None, help="gravac's TensorBoard logs (rank 0)")
    parser.add_argument("--report", type=Path, default=None, help="write rank{R}.json here")
    parser.add_argument(
        "--precision",
        default="32",
        choices=["32", "16-mixed"],
        help="16-mixed: float16 autocast and gravac.amp.GradScaler",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # 2 processes on a small machine: one core each
    seed_everything(0, verbose=False)
    train_x, train_y, test_x, test_y = digits_data()
    loader = DataLoader(
        TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True, drop_last=True
    )  # Lightning gives each rank its own shard (a DistributedSampler)
    model = Digits(args.lr)
    state = GravacHookState(
        compressor=args.compressor,
        policy=args.policy,
        window=20,
        warmup_steps=40,
        ewma_alpha=0.2,
        batch_size=args.batch_size,
        monitor=args.log_dir,
    )
    precision = None
    if args.precision == "16-mixed":  # the scaler rescales the hook's residuals with its scale
        scaler = gravac.amp.GradScaler("cpu", hooks=[state])
        precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy=DDPStrategy(process_group_backend="gloo"),
        callbacks=[GravacCallback(state)],
        plugins=precision,
        max_steps=args.max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)

    model.eval()
    with torch.no_grad():
        accuracy = float((model.net(test_x).argmax(dim=1) == test_y).float().mean())
    report_run(
        state.engine,
        model,
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        accuracy=accuracy,
        report_dir=args.report,
    )
    trainer.strategy.barrier()  # tear down together (see examples/train_digits.py)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Per-rank checkpoints and torchrun's restarts: a killed rank, and the run resumes bit for bit.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/torchrun_restarts.py \\
        --checkpoint-dir runs/restarts --fail-at-step 5

Every rank saves its own checkpoint after every step (the model and ``opt.state_dict()``: the
wrapped optimizer, the residuals, the controller) and keeps its last two; a worker resumes
from the latest step that every rank saved. ``--fail-at-step K`` kills rank 1 at step K once
(a marker file in the checkpoint folder says it did): torchrun then restarts both workers,
and the run ends with the parameters of a run that was never interrupted. Each rank writes
its final parameters to ``final-rank{rank}.pt`` in the checkpoint folder.

The group is joined with :func:`gravac.init_restartable_group`: under torch 2.13 a
restarted worker cannot join a group made by plain ``init_process_group`` (README, "Resuming
and torchrun restarts"). The CF is fixed (``--cf``) for the run to be reproducible bit for
bit: an adaptive policy resumes as exactly, but its CFs follow the measured step times.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gravac

#: checkpoint files: one per step and rank
CHECKPOINT = "step{step:06d}-rank{rank}.pt"
#: the marker of the failure, made before it
FAILED = "failed-once"


def checkpoint(folder: Path, step: int, rank: int) -> Path:
    """The checkpoint file of ``rank`` after ``step``."""
    return folder / CHECKPOINT.format(step=step, rank=rank)


def latest_complete(folder: Path, world_size: int) -> int | None:
    """The latest step whose checkpoint every rank saved (``None``: none). The ranks are never
    more than one step apart (each step's collectives wait for every rank's gradients, sent
    after its previous checkpoint), and each keeps its last two: that step is one of them."""
    steps = {int(p.name[4:10]) for p in folder.glob("step*-rank*.pt")}
    complete = [
        s for s in steps if all(checkpoint(folder, s, r).exists() for r in range(world_size))
    ]
    return max(complete, default=None)


def main() -> None:
    """Train ``--steps`` steps, resuming from the checkpoints if there are any."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cf", type=float, default=8.0, help="Top-k's fixed CF")
    parser.add_argument("--fail-at-step", type=int, help="kill rank 1 once at this step")
    args = parser.parse_args()
    if args.fail_at_step is not None and not 0 <= args.fail_at_step < args.steps:
        parser.error(
            f"--fail-at-step must be in [0, --steps) = [0, {args.steps}), got {args.fail_at_step}"
        )

    gravac.init_restartable_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder: Path = args.checkpoint_dir
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    gravac.broadcast_parameters(model)
    opt = gravac.GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        compressor="topk",
        policy="fixed",
        policy_options={"cf": args.cf},
    )
    start = 0
    resumed = latest_complete(folder, world)
    if resumed is not None:
        saved = torch.load(checkpoint(folder, resumed, rank), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = resumed + 1
        print(f"rank {rank}: resumed after step {resumed}", flush=True)
    for step in range(start, args.steps):
        if step == args.fail_at_step and rank == 1 and not (folder / FAILED).exists():
            (folder / FAILED).touch()
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no exit code
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        path = checkpoint(folder, step, rank)
        partial = path.with_suffix(".partial")  # a rank killed while saving leaves no checkpoint
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, partial)
        os.replace(partial, path)
        checkpoint(folder, step - 2, rank).unlink(missing_ok=True)
    torch.save([p.detach() for p in model.parameters()], folder / f"final-rank{rank}.pt")
    opt.close()
    del opt
    gravac.release_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

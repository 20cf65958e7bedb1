"""The gravac demo as a torchrun script: GraVAC + Top-k on scikit-learn's digits.

    torchrun --nproc_per_node=2 examples/train_digits.py --max-steps 300
    torchrun --nproc_per_node=2 examples/train_digits.py --ddp-hook   # the DDP comm hook
    torchrun --nproc_per_node=2 examples/train_digits.py --policy fixed --cf 100

Without ``--ddp-hook`` the model is plain and ``GravacOptimizer`` aggregates; with it the model
is wrapped in ``DistributedDataParallel`` with gravac's comm hook and a plain SGD steps.

torchrun sets the rendezvous environment; gloo runs on the CPU, NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import gravac
from gravac.ddp import GravacHookState, gravac_hook
from gravac.demo import DigitsCNN, digits_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--compressor", default="topk", choices=gravac.compressors.names())
    parser.add_argument("--policy", default="exponential", choices=gravac.control.policies.names())
    parser.add_argument("--log-dir", default="runs/torchrun-digits")
    parser.add_argument("--cf", type=float, help="the CF of --policy fixed (required there)")
    parser.add_argument("--ddp-hook", action="store_true", help="DDP + gravac's comm hook")
    args = parser.parse_args()
    if (args.policy == "fixed") != (args.cf is not None):
        parser.error(
            f"--cf goes with --policy fixed and only there, got --policy {args.policy}"
            f" and --cf {args.cf}"
        )

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    train_x, train_y, test_x, test_y = digits_data()
    train_x, train_y = train_x[rank::world].to(device), train_y[rank::world].to(device)
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    gravac.broadcast_parameters(model)
    options = {
        "compressor": args.compressor,
        "policy": args.policy,
        "window": 20,
        "warmup_steps": 40,
        "ewma_alpha": 0.2,
        "batch_size": args.batch_size,
        "monitor": args.log_dir,
    }
    if args.cf is not None:
        options["policy_options"] = {"cf": args.cf}
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net: nn.Module = model
    if args.ddp_hook:
        net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        state = GravacHookState(**options)
        net.register_comm_hook(state, gravac_hook)
        opt: torch.optim.Optimizer = sgd
        engine = state.engine
        del state  # held by the hook from here on, freed with net before the teardown
    else:
        opt = gravac.GravacOptimizer(sgd, dense_bytes=4096, **options)  # type: ignore[arg-type]
        engine = opt.engine
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.max_steps):
        idx = torch.randint(0, len(train_y), (args.batch_size,), generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(train_x[idx]), train_y[idx]).backward()
        opt.step()
        if rank == 0 and step % 50 == 0 and engine.last_record is not None:
            print(f"step {step}: CF sent {engine.last_record.cf_sent}", flush=True)
    engine.close_monitor()
    if rank == 0:
        model.eval()
        with torch.no_grad():
            pred = model(test_x.to(device)).argmax(dim=1).cpu()
        print(f"test accuracy {float((pred == test_y).float().mean()):.4f}")
        dense = engine.total_dense_wire_bytes
        print(f"wire bytes {engine.total_wire_bytes:,} (dense fp32 {dense:,})")
        print(f"aggregated in {engine.topology}")
    # Free what holds the process group (DDP's reducer; gravac's engine, which the optimizer's
    # gradient hooks keep in a reference cycle) and leave together, then tear down.
    del net, opt, engine
    gravac.release_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

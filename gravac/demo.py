"""``gravac demo``: GraVAC on a small CNN, scikit-learn's digits, 2 gloo workers on this machine.

The digits data set (1,797 8x8 images) ships inside scikit-learn, so nothing is downloaded. The
command spawns the workers itself (loopback only), trains with ``GravacOptimizer`` (Top-k and the
exponential policy by default), writes TensorBoard logs under ``runs/``, a PNG of the CF sent and
the test accuracy over steps, and prints a closing table; ``--json`` prints a summary object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gravac import compressors
from gravac.control import policies
from gravac.control.options import ControllerConfig
from gravac.launch import spawn_workers
from gravac.monitor import TensorBoardMonitor
from gravac.optimizer import GravacOptimizer, broadcast_parameters

__all__ = [
    "DemoConfig",
    "DigitsCNN",
    "add_parser",
    "digits_data",
    "digits_file_arrays",
    "run_demo",
    "train_worker",
]

#: share of the digits held out for testing
TEST_FRACTION = 0.2
#: the split and the model initialisation are seeded so runs compare
DATA_SEED = 0
#: tensors of fewer bytes travel dense: this small model's biases and its last layer; every
#: other matrix is compressed (the library's default, 1 MiB, is meant for real models)
DEMO_DENSE_BYTES = 4096
#: where the workers train, and the process-group backend of each
DEVICES = {"cpu": "gloo", "cuda": "nccl"}
#: the largest learning rate taken: the model trains in float32, and SGD's update ``-lr * g``
#: with a larger one is not a float32 number (torch raised from inside the step)
LR_MAX = torch.finfo(torch.float32).max
#: the digits as scikit-learn ships them, under its package folder: ``load_digits`` parses this
#: file, and importing scikit-learn for it costs each process about a second of CPU (it imports
#: SciPy), which every worker of a run and of the test suite paid (:func:`digits_file_arrays`)
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
#: its rows (the images) and columns (64 pixels, then the label)
DIGITS_SHAPE = (1797, 65)


def digits_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as (train_x, train_y, test_x, test_y); x in [0, 1], N x 1 x 8 x 8."""
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (1797 x 64, 0-16) and labels, as ``load_digits`` gives them: read from
    the file scikit-learn ships (:data:`DIGITS_FILE`), else through ``load_digits`` itself."""
    read = digits_file_arrays()
    if read is not None:
        return read
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - the demo extra installs it
        raise RuntimeError("the demo needs scikit-learn: pip install 'gravac[demo]'") from exc
    digits = load_digits()
    return digits.data, digits.target


def digits_file_arrays() -> tuple[np.ndarray, np.ndarray] | None:
    """The digits read from scikit-learn's :data:`DIGITS_FILE` without importing scikit-learn
    (rows of 64 pixels and the label, as ``load_digits`` parses it); ``None`` where scikit-learn
    is not installed or holds no such file of :data:`DIGITS_SHAPE`."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*DIGITS_FILE)
    if not path.is_file():
        return None
    table = np.loadtxt(path, delimiter=",")
    if table.shape != DIGITS_SHAPE:
        return None
    return table[:, :-1], table[:, -1].astype(int)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers (about 38 K parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


@dataclass(frozen=True)
class DemoConfig:
    """What one demo run trains (every field is a command-line option)."""

    workers: int = 2
    max_steps: int = 300
    batch_size: int = 32
    lr: float = 0.05
    compressor: str = "topk"
    policy: str = "exponential"
    theta_min: float = ControllerConfig.theta_min
    theta_max: float = ControllerConfig.theta_max
    epsilon: float = ControllerConfig.epsilon
    window: int = 20
    warmup_steps: int = 40
    ewma_alpha: float = 0.2
    eval_every: int = 20
    log_dir: str | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)
    #: "cpu" (gloo) or "cuda" (one GPU per worker, NCCL)
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("workers", "max_steps", "batch_size", "window", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
        if not (0 < self.lr <= LR_MAX):
            raise ValueError(f"--lr must be a number in (0, {LR_MAX:.4g}], got {self.lr}")
        try:  # the workers' controller would reject these; say so before any worker starts
            ControllerConfig(
                theta_min=self.theta_min,
                theta_max=self.theta_max,
                epsilon=self.epsilon,
                window=self.window,
                warmup_steps=self.warmup_steps,
                ewma_alpha=self.ewma_alpha,
            )
        except ValueError as exc:
            raise ValueError(f"--{str(exc).replace('_', '-')}") from None
        compressors.get(self.compressor)
        try:
            policies.create(self.policy, **self.policy_options)
        except ValueError as exc:
            raise ValueError(f"--policy {self.policy}: {exc}") from None
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < self.workers:
            raise ValueError(
                f"--device cuda needs one GPU per worker: --workers {self.workers}, "
                f"{torch.cuda.device_count()} GPU(s) visible"
            )


def _accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(dim=1) == y).float().mean())
    model.train()
    return acc


def train_worker(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    """One worker: its shard of the training set, GraVAC, evaluation and logs on rank 0."""
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_x, train_y, test_x, test_y = (t.to(device) for t in digits_data())
    shard = torch.arange(rank, len(train_y), world_size, device=device)
    train_x, train_y = train_x[shard], train_y[shard]
    torch.manual_seed(DATA_SEED)
    model = DigitsCNN().to(device)
    broadcast_parameters(model)
    monitor = TensorBoardMonitor(cfg.log_dir) if rank == 0 and cfg.log_dir else None
    opt = GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9),
        compressor=cfg.compressor,
        policy=cfg.policy,
        policy_options=cfg.policy_options or None,
        theta_min=cfg.theta_min,
        theta_max=cfg.theta_max,
        epsilon=cfg.epsilon,
        window=cfg.window,
        warmup_steps=cfg.warmup_steps,
        ewma_alpha=cfg.ewma_alpha,
        dense_bytes=DEMO_DENSE_BYTES,
        batch_size=cfg.batch_size,
        monitor=monitor,
    )
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    bar = _progress(cfg.max_steps, rank)
    cf_trajectory: list[float] = []
    candidates: list[float | None] = []
    achieved: list[float] = []
    accuracy: list[tuple[int, float]] = []
    for step in range(cfg.max_steps):
        idx = torch.randint(0, len(train_y), (cfg.batch_size,), generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        opt.step()
        record = opt.last_record
        if record is not None:
            cf_trajectory.append(record.cf_sent)
            candidates.append(record.cf_candidate)
            achieved.append(record.cf_achieved)
        if rank == 0 and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps):
            acc = _accuracy(model, test_x, test_y)
            accuracy.append((step + 1, acc))
            if bar is None:  # no terminal: a progress line per evaluation, on stderr
                print(
                    f"gravac demo: step {step + 1}/{cfg.max_steps}, test accuracy {acc:.4f}, "
                    f"CF sent {cf_trajectory[-1] if cf_trajectory else None}",
                    file=sys.stderr,
                    flush=True,
                )
            if monitor is not None:
                monitor.writer.add_scalar("demo/test_accuracy", acc, step + 1)
                monitor.writer.add_scalar("demo/train_loss", float(loss.detach()), step + 1)
        if bar is not None:
            bar.set_postfix(cf=cf_trajectory[-1] if cf_trajectory else None, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    opt.close()
    return {
        "final_accuracy": _accuracy(model, test_x, test_y),
        "accuracy": accuracy,
        "cf_trajectory": cf_trajectory,
        "cf_candidates": candidates,
        "cf_achieved": achieved,
        "wire_bytes": opt.total_wire_bytes,
        "dense_wire_bytes": opt.total_dense_wire_bytes,
        "skipped_steps": opt.skipped_steps,
    }


def _progress(total: int, rank: int) -> Any:
    if rank != 0 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - the demo extra installs it
        return None
    return tqdm(total=total, desc="gravac demo", unit="step")


def _plot(result: dict[str, Any], dense: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cf, ax_acc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps = range(1, len(result["cf_trajectory"]) + 1)
    candidates = [float("nan") if c is None else c for c in result["cf_candidates"]]
    ax_cf.plot(steps, candidates, "x", markersize=3, color="tab:red", label="candidate evaluated")
    ax_cf.step(steps, result["cf_trajectory"], where="post", label="CF sent")
    ax_cf.set_yscale("log")
    ax_cf.set_ylabel("compression factor")
    ax_cf.legend()
    xs, ys = zip(*result["accuracy"], strict=True)
    ax_acc.plot(xs, ys, marker="o", label="GraVAC")
    if dense is not None:
        dx, dy = zip(*dense["accuracy"], strict=True)
        ax_acc.plot(dx, dy, marker=".", label="dense")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(cfg: DemoConfig, *, compare_dense: bool = False) -> dict[str, Any]:
    """Train with ``cfg`` (and a dense baseline when asked); the summary of the run."""
    start = time.perf_counter()
    backend = DEVICES[cfg.device]
    if cfg.log_dir is not None:  # before any worker starts, not in rank 0 after the others
        try:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--log-dir {cfg.log_dir!r} cannot be made: {exc}") from None
    results = spawn_workers(train_worker, cfg.workers, cfg, backend=backend)
    main = results[0]
    if any(r["cf_trajectory"] != main["cf_trajectory"] for r in results[1:]):
        raise RuntimeError("workers chose different CFs: this is a bug, please report it")
    dense = None
    if compare_dense:
        dense_cfg = DemoConfig(
            **{
                **asdict(cfg),
                "compressor": "none",
                "policy": "fixed",
                "policy_options": {"cf": 1.0},
                "log_dir": None if cfg.log_dir is None else f"{cfg.log_dir}-dense",
            }
        )
        dense = spawn_workers(train_worker, cfg.workers, dense_cfg, backend=backend)[0]
    used = sorted(set(main["cf_trajectory"]))
    summary = {
        "final_accuracy": main["final_accuracy"],
        "dense_accuracy": None if dense is None else dense["final_accuracy"],
        "wire_bytes": main["wire_bytes"],
        "dense_wire_bytes": main["dense_wire_bytes"],
        "wire_reduction": main["dense_wire_bytes"] / max(main["wire_bytes"], 1),
        "cf_trajectory": main["cf_trajectory"],
        "cfs_used": used,
        "steps_per_cf": {str(cf): main["cf_trajectory"].count(cf) for cf in used},
        "accuracy": main["accuracy"],
        "world_size": cfg.workers,
        "compressor": cfg.compressor,
        "policy": cfg.policy,
        "steps": cfg.max_steps,
        "skipped_steps": main["skipped_steps"],
        "seconds": time.perf_counter() - start,
        "log_dir": cfg.log_dir,
    }
    if cfg.log_dir is not None:
        plot = Path(cfg.log_dir) / "cf_and_accuracy.png"
        _plot(main, dense, plot)
        summary["plot"] = str(plot)
    return summary


def _table(summary: dict[str, Any]) -> str:
    rows = [
        ("compressor / policy", f"{summary['compressor']} / {summary['policy']}"),
        ("workers, steps", f"{summary['world_size']}, {summary['steps']}"),
        ("test accuracy (GraVAC)", f"{summary['final_accuracy']:.4f}"),
    ]
    if summary["dense_accuracy"] is not None:
        rows.append(("test accuracy (dense)", f"{summary['dense_accuracy']:.4f}"))
    rows += [
        ("wire bytes (GraVAC)", f"{summary['wire_bytes']:,}"),
        ("wire bytes (dense fp32)", f"{summary['dense_wire_bytes']:,}"),
        ("reduction", f"{summary['wire_reduction']:.1f}x"),
        ("steps per CF sent", ", ".join(f"{k}: {v}" for k, v in summary["steps_per_cf"].items())),
        ("seconds", f"{summary['seconds']:.1f}"),
    ]
    if "plot" in summary:
        rows += [("TensorBoard logs", str(summary["log_dir"])), ("plot", summary["plot"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_parser(subparsers: Any) -> None:
    """Register ``gravac demo``."""
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="train a small CNN on digits with GraVAC (2 workers)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=d.workers, help="processes (gloo, loopback)")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="training steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per worker")
    p.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate (momentum 0.9)")
    p.add_argument(
        "--compressor", default=d.compressor, choices=compressors.names(), help="compressor"
    )
    p.add_argument("--policy", default=d.policy, choices=policies.names(), help="CF policy")
    p.add_argument("--cf", type=float, default=None, help="the CF of --policy fixed")
    p.add_argument("--theta-min", type=float, default=d.theta_min, help="lowest CF searched")
    p.add_argument("--theta-max", type=float, default=d.theta_max, help="highest CF searched")
    p.add_argument(
        "--epsilon", type=float, default=d.epsilon, help="least smoothed gain to send compressed"
    )
    p.add_argument("--window", type=int, default=d.window, help="steps per candidate CF")
    p.add_argument(
        "--warmup-steps", type=int, default=d.warmup_steps, help="steps before the search"
    )
    p.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="steps between test evaluations"
    )
    p.add_argument(
        "--log-dir", default=None, help="TensorBoard logs and plot (None: runs/<compressor>-<time>)"
    )
    p.add_argument("--compare-dense", action="store_true", help="also train dense, compare")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead")
    p.add_argument(
        "--device", default=d.device, choices=list(DEVICES), help="cuda: a GPU per worker, NCCL"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.policy == "fixed" and args.cf is None:
        raise ValueError("--policy fixed needs --cf")
    if args.policy != "fixed" and args.cf is not None:
        raise ValueError(
            f"--cf {args.cf:g} is the CF of --policy fixed; --policy {args.policy} searches the "
            "CFs from --theta-min to --theta-max"
        )
    log_dir = args.log_dir or f"runs/{args.compressor}-{time.strftime('%Y%m%d-%H%M%S')}"
    options = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if f.name in vars(args)}
    options["log_dir"] = log_dir
    options["policy_options"] = {"cf": args.cf} if args.policy == "fixed" else {}
    cfg = DemoConfig(**options)
    summary = run_demo(cfg, compare_dense=args.compare_dense)
    print(json.dumps(summary) if args.json else _table(summary))
    return 0

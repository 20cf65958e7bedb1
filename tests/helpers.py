"""Small models and data shared by the optimizer tests."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn


def tiny_model(seed: int = 0) -> nn.Module:
    """Two linear layers and a conv: 2-D, 4-D and 1-D parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


#: sample budgets under which :func:`tiny_model`'s 8,548 compressed elements are sampled
#: more thinly than at the base strides: the window at 128 (not 16), the shadows at 512 (not 64)
SMALL_BUDGETS = (128, 32)


@contextlib.contextmanager
def sample_budgets(budgets: tuple[int, int] | None) -> Iterator[None]:
    """The window's and the shadows' sample budgets set to ``budgets`` (elements: window,
    shadow; ``gravac.control.window.SAMPLE_BUDGET``, ``gravac.control.replay.SHADOW_BUDGET``)
    inside the block, as a large model meets the real ones; restored after it (worker
    processes are shared between tests). ``None``: the real ones."""
    from gravac.control import replay
    from gravac.control import window as sums

    before = sums.SAMPLE_BUDGET, replay.SHADOW_BUDGET
    if budgets is not None:
        sums.SAMPLE_BUDGET, replay.SHADOW_BUDGET = budgets
    try:
        yield
    finally:
        sums.SAMPLE_BUDGET, replay.SHADOW_BUDGET = before


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data, different per rank and step."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(size, 1, 8, 8, generator=gen)
    y = torch.randint(0, 10, (size,), generator=gen)
    return x, y


#: the search's omega on :func:`counter_clock`'s tiny models: there no CF's compression
#: throughput beats theta_min's by the default 0.1 (at least half of the held-back energy counts
#: as signal, MIN_SIGNAL_SHARE), so the search would keep theta_min; with 0.01 it moves
MOVING_OMEGA = 0.01


def counter_clock() -> Callable[[], float]:
    """A deterministic clock: every call is one (exactly representable) second later."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    opt.zero_grad()
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


class Records:
    """A monitor that keeps every step record."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def log(self, record: Any) -> None:
        self.items.append(record)

    def close(self) -> None:
        pass


def windowed_optimizer(
    monitor: Records, window: int, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny model and a GravacOptimizer around its SGD with windows of ``window`` steps after
    a warm-up of 2, a counter clock and ``monitor``."""
    from gravac import GravacOptimizer

    torch.manual_seed(0)
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GravacOptimizer(
        sgd, window=window, warmup_steps=2, monitor=monitor, clock=counter_clock(), **options
    )
    return model, opt


def resume_windowed(monitor: Records, window: int, split: int, end: int, **options: Any) -> None:
    """Train steps ``[0, split)`` through :func:`windowed_optimizer`, then steps ``[split,
    end)`` through a new one loaded from the first's state (model and optimizer), both logging
    to ``monitor``."""
    model_a, opt_a = windowed_optimizer(monitor, window, **options)
    train_square(model_a, opt_a, range(split))
    model_b, opt_b = windowed_optimizer(monitor, window, **options)
    model_b.load_state_dict(model_a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    train_square(model_b, opt_b, range(split, end))


def through_torch_save(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` saved with ``torch.save`` and loaded back, as a checkpoint is."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    buf.seek(0)
    return dict(torch.load(buf, weights_only=False))


def train_square(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """Steps on the mean square of the model's output for seeded random inputs."""
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 1, 8, 8, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def run_compare(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``gravac compare`` with ``args``, through the command line in a process of its own (its
    stdout and stderr captured)."""
    command = [sys.executable, "-m", "gravac", "compare", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (ended, not yet reaped by the process that
    inherited it) has ended."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def tmpdir_env(tmp: Path) -> dict[str, str]:
    """This process's environment with ``TMPDIR`` the folder ``tmp`` (made here if missing),
    for a process whose temporary files a test reads or keeps out of the machine's."""
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def torchrun_env(beside: Path) -> dict[str, str]:
    """:func:`tmpdir_env` with a folder beside ``beside``: a torchrun agent leaves a
    ``torchelastic_*`` folder in the temporary folder after each run, which then goes with the
    test's own files rather than into the machine's."""
    return tmpdir_env(beside.with_name(beside.name + "-tmp"))


def torchrun_command(script: Path, *args: str, nproc: int = 2) -> list[str]:
    """The command that runs ``script`` with ``args`` on ``nproc`` processes on loopback."""
    from gravac.launch import free_port

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None, "torchrun is installed with torch"
    return [
        torchrun,
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py`` (the scripts folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

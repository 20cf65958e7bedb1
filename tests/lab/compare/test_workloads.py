"""The ``gravac compare`` workloads: data, model, loss and metric of every registered one, and a
loopback smoke run of each through the real command line (a process of its own, started with
the session by tests/background.py)."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gravac_lab.compare import workloads
from gravac_lab.compare.config import CompareConfig
from tests.background import Background
from tests.helpers import run_compare

NAMES = workloads.names()
#: samples in the one-process batches below
BATCH = 16
#: SGD steps on one fixed batch, and the share of its loss they must at least remove (the
#: slowest, tiny-digits at lr 0.05, removes 7%)
SGD_STEPS = 8
MIN_LOSS_DROP = 0.05
#: lstm-text's loss only leaves the byte-frequency plateau quickly at a higher rate than the
#: compare default (0.05; see the workloads module)
SGD_LR = {"lstm-text": 1.0}
DEFAULT_SGD_LR = 0.05
#: lstm-text's test set: 256 windows (an evaluation in well under a second)
TEXT_TEST_WINDOWS = 256
#: an untrained model's test perplexity must lie within this factor of a uniform guess's
UNTRAINED_PERPLEXITY_FACTOR = 2.0


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread, as a compare worker has: on a small shared host more only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _seeded_model(workload: workloads.Workload) -> nn.Module:
    torch.manual_seed(0)
    return workload.model()


def _batch(workload: workloads.Workload) -> tuple[Tensor, Tensor]:
    train_x, train_y, _, _ = workload.data()
    idx = torch.randint(0, len(train_y), (BATCH,), generator=torch.Generator().manual_seed(0))
    return train_x[idx], train_y[idx]


@pytest.mark.parametrize("name", NAMES)
def test_data_shapes_and_dtypes(name: str) -> None:
    train_x, train_y, test_x, test_y = workloads.get(name).data()
    assert len(train_x) == len(train_y) > 0
    assert len(test_x) == len(test_y) > 0
    assert train_x.shape[1:] == test_x.shape[1:]
    assert train_y.shape[1:] == test_y.shape[1:]
    assert train_y.dtype == test_y.dtype == torch.int64


@pytest.mark.parametrize("name", NAMES)
def test_data_is_deterministic(name: str) -> None:
    first = workloads.get(name).data()
    workloads.stdlib_text.cache_clear()  # read the text files again
    second = workloads.get(name).data()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_text_windows_are_the_text_in_order() -> None:
    train_x, train_y, test_x, test_y = workloads.text_data()
    text = workloads.stdlib_text()
    assert train_x.dtype == test_x.dtype == torch.int64
    assert train_x.shape == train_y.shape and train_x.dim() == 2
    assert test_x.shape == test_y.shape == (TEXT_TEST_WINDOWS, train_x.shape[1])
    # the windows tile the start of the text; each target is the next byte
    assert bytes(train_x.flatten().tolist()) == text[: train_x.numel()]
    assert bytes(train_y.flatten().tolist()) == text[1 : train_y.numel() + 1]
    # the test windows come from the text after the training windows
    tail = text[train_x.numel() :]
    for i in (0, len(test_x) - 1):
        assert bytes(test_x[i].tolist()) in tail
        assert bytes(test_y[i, :-1].tolist()) == bytes(test_x[i, 1:].tolist())
    assert int(train_x.min()) >= 0 and int(train_x.max()) < workloads.TEXT_VOCABULARY


def test_text_is_the_listed_modules_sources() -> None:
    assert list(workloads.TEXT_MODULES) == sorted(workloads.TEXT_MODULES)
    sources = [
        Path(str(inspect.getsourcefile(importlib.import_module(m)))).read_bytes()
        for m in workloads.TEXT_MODULES
    ]
    assert workloads.stdlib_text() == b"".join(sources)


@pytest.mark.parametrize("name", NAMES)
def test_forward_loss_backward(name: str) -> None:
    workload = workloads.get(name)
    model = _seeded_model(workload)
    x, y = _batch(workload)
    loss = workload.loss(model(x), y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", NAMES)
def test_few_sgd_steps_lower_the_training_loss(name: str) -> None:
    workload = workloads.get(name)
    model = _seeded_model(workload)
    x, y = _batch(workload)
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR.get(name, DEFAULT_SGD_LR), momentum=0.9)
    losses = []
    for _ in range(SGD_STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert losses[-1] < (1 - MIN_LOSS_DROP) * losses[0], losses


@pytest.mark.parametrize("name", NAMES)
def test_metric_direction(name: str) -> None:
    workload = workloads.get(name)
    target = workload.target
    better, worse = (target + 1, target - 1) if workload.higher_is_better else (1.0, target + 1)
    assert workload.reached(target, target)
    assert workload.reached(better, target)
    assert not workload.reached(worse, target)


def test_new_workloads_metrics() -> None:
    resnet, lstm = workloads.get("resnet-digits"), workloads.get("lstm-text")
    assert resnet.higher_is_better and resnet.metric_name == "test accuracy"
    assert resnet.target == workloads.DEFAULT_TARGET
    assert not lstm.higher_is_better and lstm.metric_name == "test perplexity"
    assert lstm.reached(lstm.target - 0.5, lstm.target)
    assert not lstm.reached(lstm.target + 0.5, lstm.target)


class _Uniform(nn.Module):
    """Logits of zero for every byte: perplexity exactly the vocabulary's size."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros(*x.shape, workloads.TEXT_VOCABULARY)


def test_perplexity_of_a_uniform_model_is_the_vocabulary() -> None:
    _, _, test_x, test_y = workloads.text_data()
    value = workloads.perplexity(_Uniform(), test_x, test_y)
    torch.testing.assert_close(value, float(workloads.TEXT_VOCABULARY), rtol=1e-5, atol=0.0)


def test_untrained_perplexity_is_about_the_vocabulary() -> None:
    workload = workloads.get("lstm-text")
    model = _seeded_model(workload)
    _, _, test_x, test_y = workload.data()
    value = workload.metric(model, test_x, test_y)
    uniform = workloads.TEXT_VOCABULARY
    assert uniform / UNTRAINED_PERPLEXITY_FACTOR < value < uniform * UNTRAINED_PERPLEXITY_FACTOR
    assert model.training  # the metric restores the training mode


def test_accuracy_keeps_the_evaluation_mode() -> None:
    workload = workloads.get("resnet-digits")
    model = _seeded_model(workload)
    _, _, test_x, test_y = workload.data()
    model.eval()
    accuracy = workload.metric(model, test_x, test_y)
    assert not model.training
    assert 0.0 <= accuracy <= 1.0


def test_parameter_counts() -> None:
    counts = {n: workloads.parameter_count(workloads.get(n).model()) for n in NAMES}
    assert counts["resnet-digits"] == 696_042
    assert counts["lstm-text"] == 938_240
    assert counts["mlp-digits"] == 33_869_834


# --- the real command line, on loopback --------------------------------------------------------

#: the modes of each workload's smoke run: gravac on every one; DDP's mode, whose code differs
#: between workloads only by their model, data and metric, on lstm-text alone, the workload
#: whose model (recurrent), loss and metric (perplexity) are not the digits' (a mode costs two
#: more workers: 7-12 s of CPU a run)
SMOKE_MODES = {"lstm-text": ["ddp", "gravac"]}
SMOKE_DEFAULT_MODES = ["gravac"]
#: a timing warm-up of one step, and the fewest steps it allows: the smoke run trains and
#: times a step in each mode (mlp-digits' 34M parameters make every step count)
SMOKE_WARMUP = 1
SMOKE_STEPS = SMOKE_WARMUP + 1
#: the metric's range after a few steps: accuracy, or a perplexity no worse than twice uniform
METRIC_RANGE = {
    "vgg-digits": (0.0, 1.0),
    "resnet-digits": (0.0, 1.0),
    "mlp-digits": (0.0, 1.0),
    "lstm-text": (1.0, UNTRAINED_PERPLEXITY_FACTOR * workloads.TEXT_VOCABULARY),
}


#: what a smoke run left: its exit, its stdout and stderr, and the JSON it wrote
Smoke = tuple[subprocess.CompletedProcess[str], Path]


def _modes(name: str) -> list[str]:
    """The modes of ``name``'s smoke run (:data:`SMOKE_MODES`)."""
    return SMOKE_MODES.get(name, SMOKE_DEFAULT_MODES)


def _compare(out: Path, name: str) -> Smoke:
    """``gravac compare`` on ``name``, through the command line in a process of its own."""
    done = run_compare(
        "--quick", "--workload", name, "--modes", ",".join(_modes(name)),
        "--steps", str(SMOKE_STEPS), "--timing-warmup", str(SMOKE_WARMUP), "--out", str(out),
    )  # fmt: skip
    return done, out


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Smoke]]:
    """A smoke run per workload a selected test reads (tests/background.py starts them with
    the session)."""
    selected = {i.callspec.params["name"] for i in items if hasattr(i, "callspec")}
    chosen = sorted(selected & set(METRIC_RANGE))
    return {name: functools.partial(_compare, tmp / f"{name}.json", name) for name in chosen}


@pytest.fixture(scope="module")
def smoke_runs(background: Background, request: pytest.FixtureRequest) -> dict[str, Smoke]:
    """The module's smoke runs (``launches``), once all have ended."""
    return background.results(request)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METRIC_RANGE))
def test_compare_runs_the_workload(smoke_runs: dict[str, Smoke], name: str) -> None:
    workload = workloads.get(name)
    done, out = smoke_runs[name]
    assert done.returncode == 0, done.stderr[-2000:]
    summary, stdout = json.loads(out.read_text()), done.stdout
    assert summary["workload"]["name"] == name
    assert summary["workload"]["metric"] == workload.metric_name
    assert summary["workload"]["target"] == workload.target
    assert summary["workload"]["parameters"] == workloads.parameter_count(workload.model())
    low, high = METRIC_RANGE[name]
    runs = summary["runs"]
    assert [r["mode"] for r in runs] == _modes(name)
    for r in runs:
        assert r["steps"] == SMOKE_STEPS
        assert [e[0] for e in r["evaluations"]] == [SMOKE_STEPS]
        assert low <= r["final_metric"] <= high
    assert f"final {workload.metric_name}" in stdout
    for mode in _modes(name):
        assert f"| {mode} |" in stdout


def test_the_learning_rate_is_the_workloads_unless_given() -> None:
    assert CompareConfig(workload="lstm-text").lr_value == 1.0
    assert CompareConfig(workload="vgg-digits").lr_value == 0.05
    assert CompareConfig(workload="lstm-text", lr=0.3).lr_value == 0.3
    with pytest.raises(ValueError, match="--lr must be > 0"):
        CompareConfig(lr=0.0)

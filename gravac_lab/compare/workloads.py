"""What ``gravac compare`` trains: a model, its data, and the metric a run is judged by.

A :class:`Workload` is a frozen record: a model factory (called after the same seed on every
rank, so every rank starts from the same weights), the data split, the metric and its target.
:data:`WORKLOADS` maps names to workloads; to add one, write its record and add it there.

* ``vgg-digits`` (the default): a communication-heavy VGG-style CNN on scikit-learn's digits
  (8x8 images, used as they are): two 3x3 convolutions of 64 and 128 channels, then
  Linear(8192, 640) and Linear(640, 10), 5,324,426 parameters. A step of batch 32 is about
  2 GFLOP of forward and backward against 21.3 MB of float32 gradient: with one CPU thread per
  worker, forward and backward take 40-80 ms and sending the gradient over 1 Gbit/s 180 ms,
  the regime gradient compression is for.
* ``tiny-digits``: the demo's :class:`gravac.demo.DigitsCNN` (38 K parameters), for the quick
  CI mode (``gravac compare --quick``).
* ``resnet-digits``: a compute-heavy :class:`ResNetDigits` on the same digits: a 3x3 stem and
  six BasicBlocks with batch norm (two each at 32 channels 8x8, 64 channels 4x4, 128 channels
  2x2), average pooling and Linear(128, 10); 696,042 parameters in 47 tensors, 2.8 MB of
  float32 gradient against about 1.3 GFLOP of forward and backward a step (batch 32): five
  times VGG's compute per byte sent, so compression has less to win (1 Gbit/s moves the
  gradient in 22 ms; forward and backward take 30-40 ms on one thread). It stresses the
  per-tensor costs (many small tensors: batch-norm scales and biases, 3x3 kernels) and the
  batch-norm running statistics, buffers that are not gradients. Target: test accuracy 0.95,
  which dense DDP (2 workers, lr 0.05) reaches at step 80 of 300 (0.936 at 60, 0.986 at 300).
* ``mlp-digits``: a large model, :class:`WideMLP`: the 64 pixels through three hidden layers
  of 4,096 (ReLU) to the 10 classes; 33,869,834 parameters, 135 MB of float32 gradient, 99% of
  it in the two 4096 x 4096 matrices. A step of batch 32 is about 6.5 GFLOP; sending the
  gradient over 1 Gbit/s takes over a second. It stresses what grows with the model: the
  number of buckets, the size of each, and memory.
* ``lstm-text``: a character-level language model, :class:`CharLSTM` (a 64-wide byte
  embedding, two LSTM layers of 256, Linear(256, 256)); 938,240 parameters in 11 tensors,
  3.75 MB of gradient, 91% of it in the LSTM's four weight matrices. The text is the
  standard library's own source (:data:`TEXT_MODULES`, read from this Python's files:
  nothing is downloaded; 792,793 bytes on 3.11), as bytes (vocabulary 256); the first 90% is
  cut into 22 K windows of 32 bytes, each with the next byte of every position as targets,
  and 256 windows spread over the last 10% (the end of ``typing``) are the test set. A step
  (batch 32, so 1,024 characters) is about 5.6 GFLOP of forward and backward through time
  (80-100 ms on one thread), against 30 ms of sending at 1 Gbit/s. It stresses recurrent
  gradients: the LSTM's weight gradients accumulate over all 32 time steps and are ready only
  near the end of backward, so there is little backward left to hide communication behind.
  Metric: test perplexity, ``exp`` of the mean next-byte cross-entropy (256 untrained, 22.4
  for the byte frequencies of the training text). Target: 8.5, which dense DDP (2 workers)
  reaches at step 120 of 300 with ``--lr 1`` (8.3; 5.0 at 300).

  An LSTM trained by SGD needs a larger learning rate than the CNNs, so the workload's is 1
  (:data:`_LSTM_LR`): at the CNNs' 0.05 dense DDP is still at 19.5 at step 100 and 16.2 at 300,
  barely past the byte frequencies (2 learns as fast as 1; the loss is the mean over
  positions). The text, and so the figures, differ a little between Python versions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gravac.demo import DigitsCNN, digits_data

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_WORKLOAD",
    "QUICK_WORKLOAD",
    "TEXT_MODULES",
    "TEXT_VOCABULARY",
    "WORKLOADS",
    "BasicBlock",
    "CharLSTM",
    "ResNetDigits",
    "VggDigitsCNN",
    "WideMLP",
    "Workload",
    "classification_accuracy",
    "get",
    "names",
    "parameter_count",
    "perplexity",
    "sequence_cross_entropy",
    "stdlib_text",
    "text_data",
]

#: test accuracy the time-to-target clock stops at (the digits models reach it in a few
#: hundred steps of batch 32 per worker)
DEFAULT_TARGET = 0.95
#: ``lstm-text``'s target test perplexity: dense DDP with ``--lr 1`` reaches it at step 120 of
#: 300, well past the byte frequencies' 22.4 (see the module docstring)
_LSTM_TARGET = 8.5
#: ``lstm-text``'s SGD learning rate (see the module docstring)
_LSTM_LR = 1.0
#: the workload of a full run
DEFAULT_WORKLOAD = "vgg-digits"
#: the workload of ``--quick``
QUICK_WORKLOAD = "tiny-digits"
#: side of the digits images
_IMAGE_SIDE = 8
#: ``mlp-digits``'s hidden layers and their width
_MLP_DEPTH = 3
_MLP_WIDTH = 4096
#: digit classes
_CLASSES = 10
#: ``lstm-text``'s corpus: these standard-library modules' source files, in this (sorted)
#: order. Each is a single ``.py`` file in every CPython from 3.10 on; together 793 KB on 3.11,
#: so 300 steps of 2 x 32 windows read 0.86 of the training text
TEXT_MODULES = (
    "argparse",
    "ast",
    "calendar",
    "configparser",
    "dataclasses",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "inspect",
    "textwrap",
    "typing",
)
#: ``lstm-text`` models bytes: the vocabulary does not depend on the text, so neither does the
#: model (the sources use 100 distinct bytes: ASCII, and 12 bytes of UTF-8 on 3.11)
TEXT_VOCABULARY = 256
#: characters of a training or test window (and of the backpropagation through time)
_WINDOW = 32
#: the last share of the corpus is the test text (the end of ``typing``'s source, unseen in
#: training)
_TEXT_TEST_FRACTION = 0.1
#: test windows kept, evenly spaced over the test text: 8,192 characters, so that an evaluation
#: takes about 0.25 s on one thread
_TEXT_TEST_WINDOWS = 256


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in evaluation mode, without gradients; its mode restored on exit."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def classification_accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Share of ``x`` that ``model`` classifies as ``y`` (evaluation mode, no gradients)."""
    with _evaluating(model):
        return float((model(x).argmax(dim=1) == y).float().mean())


def sequence_cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy over every position: ``logits`` is N x T x V, ``y`` N x T."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def perplexity(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """``exp`` of ``model``'s mean next-character cross-entropy on ``x`` (evaluation mode, no
    gradients): the number of equally likely characters that would leave it as uncertain."""
    with _evaluating(model):
        return math.exp(float(sequence_cross_entropy(model(x), y)))


def parameter_count(model: nn.Module) -> int:
    """Elements of ``model``'s trainable parameters: what a dense all-reduce sends."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class VggDigitsCNN(nn.Module):
    """Two 3x3 convolutions (64, 128 channels), Linear(8192, 640), Linear(640, 10).

    No pooling: the 8x8 feature maps stay whole, so the first linear layer holds 98% of the
    5.3 M parameters, as the fully connected layers of VGG do.
    """

    #: channels of the two convolutions
    CHANNELS = (64, 128)
    #: width of the hidden linear layer
    HIDDEN = 640

    def __init__(self) -> None:
        super().__init__()
        c1, c2 = self.CHANNELS
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * _IMAGE_SIDE * _IMAGE_SIDE, self.HIDDEN),
            nn.ReLU(),
            nn.Linear(self.HIDDEN, _CLASSES),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class WideMLP(nn.Module):
    """``mlp-digits``'s model: flattened 8x8 digits through :data:`_MLP_DEPTH` hidden layers of
    :data:`_MLP_WIDTH` with ReLU, then a linear layer to the 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = _IMAGE_SIDE * _IMAGE_SIDE
        for _ in range(_MLP_DEPTH):
            layers += [nn.Linear(width, _MLP_WIDTH), nn.ReLU()]
            width = _MLP_WIDTH
        layers.append(nn.Linear(width, _CLASSES))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """He et al.'s two 3x3 convolutions with batch norm, plus the input (CVPR 2016).

    Where the block changes width or resolution, the shortcut is a strided 1x1 convolution with
    batch norm (their option B).
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.relu(self.body(x) + self.shortcut(x))


class ResNetDigits(nn.Module):
    """A 3x3 stem, three stages of :class:`BasicBlock` (8x8, 4x4, 2x2), average pool, Linear.

    A CIFAR-style ResNet scaled to 8x8 digits: each stage after the first halves the
    resolution with a stride-2 block and doubles the width.
    """

    #: width of each stage (the stem has the first)
    WIDTHS = (32, 64, 128)
    #: blocks per stage
    BLOCKS = 2

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(1, self.WIDTHS[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(self.WIDTHS[0]),
            nn.ReLU(),
        ]
        in_channels = self.WIDTHS[0]
        for stage, width in enumerate(self.WIDTHS):
            for block in range(self.BLOCKS):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, width, stride=stride))
                in_channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, _CLASSES)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class CharLSTM(nn.Module):
    """Byte embedding, a stacked LSTM, and a Linear layer to next-byte logits (N x T x 256)."""

    #: width of the byte embedding
    EMBEDDING = 64
    #: LSTM hidden state
    HIDDEN = 256
    #: stacked LSTM layers
    LAYERS = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TEXT_VOCABULARY, self.EMBEDDING)
        self.lstm = nn.LSTM(self.EMBEDDING, self.HIDDEN, self.LAYERS, batch_first=True)
        self.head = nn.Linear(self.HIDDEN, TEXT_VOCABULARY)

    def forward(self, x: Tensor) -> Tensor:
        hidden, _ = self.lstm(self.embed(x))
        return self.head(hidden)


@functools.lru_cache(maxsize=1)
def stdlib_text() -> bytes:
    """The source files of :data:`TEXT_MODULES`, concatenated in that order (read once).

    Raises:
        RuntimeError: a module has no ``.py`` source here (a sourceless install).
    """
    parts = []
    for name in TEXT_MODULES:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None else spec.origin
        if origin is None or not origin.endswith(".py"):
            raise RuntimeError(
                f"lstm-text reads the standard library's source, but module {name!r} has none "
                f"here (found {origin!r}); install Python with its .py files"
            )
        with open(origin, "rb") as f:
            parts.append(f.read())
    return b"".join(parts)


def _windows(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Consecutive windows of ``tokens`` (N x T) and the byte after each position (N x T)."""
    n = (len(tokens) - 1) // _WINDOW
    x = tokens[: n * _WINDOW].reshape(n, _WINDOW)
    y = tokens[1 : n * _WINDOW + 1].reshape(n, _WINDOW)
    return x, y


def text_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`stdlib_text` as bytes (int64): the first 90% cut into training windows, and
    :data:`_TEXT_TEST_WINDOWS` windows spread evenly over the rest for testing."""
    tokens = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
    split = int(len(tokens) * (1 - _TEXT_TEST_FRACTION))
    train_x, train_y = _windows(tokens[:split])
    test_x, test_y = _windows(tokens[split:])
    keep = torch.linspace(0, len(test_y) - 1, min(len(test_y), _TEXT_TEST_WINDOWS)).long()
    return train_x, train_y, test_x[keep], test_y[keep]


@dataclass(frozen=True)
class Workload:
    """A model, its data and the metric a run is judged by.

    Attributes:
        name: the ``--workload`` value.
        summary: one line for ``--help`` and the report.
        model: builds the model (called after seeding, identically on every rank).
        data: ``(train_x, train_y, test_x, test_y)``; each rank trains on its own shard of the
            training set and rank 0 evaluates on the whole test set.
        metric: ``metric(model, test_x, test_y)``.
        metric_name: what :attr:`metric` measures, for the report.
        target: the metric value the time-to-target clock stops at.
        higher_is_better: whether the target is reached from below (accuracy) or from above
            (perplexity).
        loss: ``loss(model(x), y)``, the training objective.
        lr: SGD's learning rate unless ``--lr`` sets one.
    """

    name: str
    summary: str
    model: Callable[[], nn.Module]
    data: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]] = digits_data
    metric: Callable[[nn.Module, Tensor, Tensor], float] = classification_accuracy
    metric_name: str = "test accuracy"
    target: float = DEFAULT_TARGET
    higher_is_better: bool = True
    lr: float = 0.05
    loss: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy

    def reached(self, value: float, target: float) -> bool:
        """Whether a metric ``value`` meets ``target`` (in the metric's direction)."""
        return value >= target if self.higher_is_better else value <= target


#: every workload, by name
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="vgg-digits",
            summary="VGG-style CNN on digits, communication-heavy",
            model=VggDigitsCNN,
        ),
        Workload(
            name="tiny-digits",
            summary="the demo's CNN on digits, for quick CI runs",
            model=DigitsCNN,
        ),
        Workload(
            name="resnet-digits",
            summary="ResNet of six BasicBlocks on digits, compute-heavy",
            model=ResNetDigits,
        ),
        Workload(
            name="mlp-digits",
            summary="wide MLP on digits (34M parameters), large",
            model=WideMLP,
        ),
        Workload(
            name="lstm-text",
            summary="character-level LSTM on standard-library source, recurrent",
            model=CharLSTM,
            data=text_data,
            metric=perplexity,
            metric_name="test perplexity",
            target=_LSTM_TARGET,
            higher_is_better=False,
            loss=sequence_cross_entropy,
            lr=_LSTM_LR,
        ),
    )
}


def names() -> list[str]:
    """The registered workload names."""
    return list(WORKLOADS)


def get(name: str) -> Workload:
    """The workload called ``name``.

    Raises:
        ValueError: no such workload; the message lists the registered ones.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"--workload must be one of {names()}, got {name!r}") from None

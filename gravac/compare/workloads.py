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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gravac.demo import DigitsCNN, digits_data

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_WORKLOAD",
    "QUICK_WORKLOAD",
    "WORKLOADS",
    "VggDigitsCNN",
    "Workload",
    "classification_accuracy",
    "get",
    "names",
    "parameter_count",
]

#: test accuracy the time-to-target clock stops at (both digits models reach it in a few
#: hundred steps of batch 32 per worker)
DEFAULT_TARGET = 0.95
#: the workload of a full run
DEFAULT_WORKLOAD = "vgg-digits"
#: the workload of ``--quick``
QUICK_WORKLOAD = "tiny-digits"
#: side of the digits images
_IMAGE_SIDE = 8
#: digit classes
_CLASSES = 10


def classification_accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Share of ``x`` that ``model`` classifies as ``y`` (evaluation mode, no gradients)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = float((model(x).argmax(dim=1) == y).float().mean())
    model.train(was_training)
    return acc


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
    """

    name: str
    summary: str
    model: Callable[[], nn.Module]
    data: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]] = digits_data
    metric: Callable[[nn.Module, Tensor, Tensor], float] = classification_accuracy
    metric_name: str = "test accuracy"
    target: float = DEFAULT_TARGET
    higher_is_better: bool = True
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

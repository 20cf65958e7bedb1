"""Fixed-order gradient buckets (docs/design.md section 3).

Parameters are taken in the order of the optimizer's param groups (lists, never sets), so every
rank builds the same layout. Frozen parameters (``requires_grad=False``) are left out. 1-D tensors
travel dense, like the bias and norm parameters that PowerSGD, CGX and BytePS skip, and so do
tensors below ``dense_bytes`` (0 by default: gravac packs small matrices into buckets and
compresses them, since a per-tensor threshold such as BytePS's 1 MiB suits tensor-by-tensor
compression, not buckets, and left a small transformer uncompressed); the rest are packed, per
dtype, into buckets of at most ``bucket_bytes`` that are compressed whole, in reverse parameter
order as DDP fills them. A bucket is keyed by its index, which is how error-feedback residuals
are stored.

A tensor larger than ``bucket_bytes`` is split across buckets of its own, by rows of its first
dimension (each piece a matrix of the tensor's trailing shape, so that PowerSGD's factors stay
meaningful), as evenly as the rows allow: each piece is compressed and sent on its own, so a
compressor's work buffers are bounded by the bucket size, not by the largest tensor, and the
first piece is on the wire while the next is compressed. The gradient stays one tensor: its
pieces are consecutive slices of one flat buffer (a :class:`Run`). DDP never splits a tensor,
so the DDP comm hook sees it whole.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Bucket",
    "Layout",
    "Run",
    "Signature",
    "build_layout",
    "check_bytes",
    "check_params",
    "check_resized",
    "default_bucket_bytes",
    "gather_grads",
    "join_flat",
    "layout_signature",
    "row_pieces",
    "scatter_grads",
    "split_flat",
]

#: default bucket size: PyTorch DDP's 25 MiB
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: the first bucket (the last layers, whose gradients are ready first) is at most this large,
#: as DDP's first bucket, so that communication starts early in backward
FIRST_BUCKET_BYTES = 2**20
#: tensors smaller than this travel dense; 0: every tensor of 2 or more dimensions is compressed
#: (docs/design.md section 3)
DEFAULT_DENSE_BYTES = 0
#: a compressor's smaller preferred bucket (:attr:`gravac.compressors.Compressor.bucket_bytes`)
#: grows so that the compressed gradient fills at most this many buckets: each costs a
#: collective and the engine's per-bucket work. On ``mlp-digits`` (135 MB of gradient, fp16,
#: 2 workers) at 1 Gbit/s the step was 0.96-1.01x PyTorch's fp16 hook's in 8.1 MiB buckets (a
#: sixteenth), 0.98-1.07x in 2 MiB and 0.98-1.05x in 25 MiB; over loopback 2 MiB buckets (66)
#: stepped 1.15-1.39x the time of 25 MiB ones (8), a sixteenth (18) 1.02-1.14x
#: (benchmarks/README.md, tenth measurement)
MAX_SMALL_BUCKETS = 16


#: what identifies a layout's parameters: each one's identity, whether it trains, and its shape
Signature = tuple[tuple[int, bool, torch.Size], ...]


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are packed, in order, into one flat tensor.

    Attributes:
        key: the bucket's index among the compressed (or the dense) buckets.
        params: its parameters, in packing order.
        dtype: their dtype.
        rows: for a piece of a tensor split across buckets, the rows ``start, end`` of its
            one parameter's first dimension that it holds; ``None``: its parameters whole.
    """

    key: int
    params: tuple[Tensor, ...]
    dtype: torch.dtype
    rows: tuple[int, int] | None = None

    @property
    def shapes(self) -> tuple[torch.Size, ...]:
        """Shapes of the packed tensors (``Round.layout``); a piece's rows for a piece."""
        if self.rows is None:
            return tuple(p.shape for p in self.params)
        (p,) = self.params
        start, end = self.rows
        return (torch.Size((end - start, *p.shape[1:])),)

    @property
    def numel(self) -> int:
        """Elements in the bucket."""
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Run:
    """Consecutive buckets whose gradients share one flat buffer: one bucket, or the pieces of
    a tensor split across buckets.

    Attributes:
        bucket: the buffer's contents as one bucket (a split tensor whole, under its first
            piece's key).
        first: the index of its first bucket in :attr:`Layout.buckets`.
        sizes: the elements of each of its buckets, in order (they tile the buffer).
    """

    bucket: Bucket
    first: int
    sizes: tuple[int, ...]

    @property
    def stop(self) -> int:
        """The index after its last bucket in :attr:`Layout.buckets`."""
        return self.first + len(self.sizes)


@dataclass(frozen=True)
class Layout:
    """Compressed buckets and dense buckets (one per dtype) of one parameter configuration."""

    compressed: tuple[Bucket, ...]
    dense: tuple[Bucket, ...]
    signature: Signature

    @property
    def params(self) -> list[Tensor]:
        """Every parameter that takes part, compressed ones first."""
        return [p for b in self.buckets for p in b.params]

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Every bucket in launch order: the compressed ones, then the dense ones."""
        return (*self.compressed, *self.dense)

    @property
    def runs(self) -> tuple[Run, ...]:
        """The buckets grouped by the flat buffer they share, in launch order."""
        runs: list[Run] = []
        for i, b in enumerate(self.buckets):
            last = runs[-1] if runs else None
            if (
                last is not None
                and b.rows is not None
                and last.bucket.params[0] is b.params[0]
                and last.stop == i
            ):
                runs[-1] = Run(last.bucket, last.first, (*last.sizes, b.numel))
                continue
            whole = Bucket(b.key, b.params, b.dtype)
            runs.append(Run(whole, i, (b.numel,)))
        return tuple(runs)


def layout_signature(params: Sequence[Tensor]) -> Signature:
    """The :data:`Signature` of ``params`` as they are now."""
    return tuple((id(p), p.requires_grad, p.shape) for p in params)


def check_resized(signature: Signature, params: Sequence[Tensor]) -> None:
    """Refuse a parameter of ``signature`` that changed shape since (its ``.data`` replaced by
    a tensor of another shape): its residual, and every per-layer state, is of the old shape.

    Raises:
        ValueError: naming the parameter's index among ``params`` and both shapes.
    """
    shapes = {key: shape for key, _, shape in signature}
    for i, p in enumerate(params):
        before = shapes.get(id(p))
        if before is not None and before != p.shape:
            raise ValueError(
                f"parameter {i} changed shape from {tuple(before)} to {tuple(p.shape)} since "
                "gravac laid out its buckets: its error-feedback residual and per-layer state "
                "are of the old shape and cannot follow it. Change shapes before building the "
                "optimizer, or close it (opt.close()) and build a new one over the resized model"
            )


def _sharding(p: Tensor) -> str | None:
    """How ``p`` is sharded across ranks, or ``None``: a ``DTensor`` (FSDP2's
    ``fully_shard``, tensor parallelism) or a parameter that FSDP (1) flattened and shards."""
    dtensors = sys.modules.get("torch.distributed.tensor")  # none made if it is not imported
    if dtensors is not None and isinstance(p, dtensors.DTensor):
        return "a DTensor (FSDP2's fully_shard, or tensor parallelism)"
    if getattr(p, "_fsdp_flattened", False) or getattr(p, "_is_flat_param", False):
        return "flattened and sharded by FullyShardedDataParallel"
    return None


def check_params(params: Sequence[Tensor]) -> None:
    """Refuse parameters a layout cannot hold: complex ones (the compressors work on real
    tensors, and a cast to a real wire format would drop the imaginary part), ones on the meta
    device (no storage: a model built there and not materialized), parameters sharded across
    ranks (FSDP, tensor parallelism), and parameters on more than one device (a rank's
    buckets, residuals and collectives live on one device).

    Raises:
        ValueError: naming the first such parameter's index, shape and dtype or device.
    """
    for i, p in enumerate(params):
        where = f"parameter {i} (shape {tuple(p.shape)}, {p.dtype}"
        if p.is_complex():
            raise ValueError(
                f"{where}) is complex: gravac's compressors work on real tensors, and casting "
                "would drop the imaginary part; keep the real and imaginary parts as two real "
                "parameters instead"
            )
        sharding = _sharding(p)
        if sharding is not None:
            raise ValueError(
                f"{where}) is {sharding}: each rank holds another part of it, and FSDP reduces "
                "its gradients itself, where gravac averages whole parameters that every rank "
                "replicates (as DDP does); train without FSDP or tensor parallelism, or leave "
                "such parameters out of the optimizer gravac wraps"
            )
        if p.is_meta:
            raise ValueError(
                f"{where}) is on the meta device, without storage: materialize the model "
                "(module.to_empty(device=...), then initialize it) before it trains"
            )
        if p.device != params[0].device:
            raise ValueError(
                f"{where}) is on {p.device}, parameter 0 on {params[0].device}: a rank's "
                "buckets and residuals live on one device; give each GravacOptimizer the "
                "parameters of one device"
            )


def default_bucket_bytes(preferred: int | None, params: Sequence[Tensor]) -> int:
    """The largest compressed bucket when the caller chooses none: DDP's
    :data:`DEFAULT_BUCKET_BYTES` where the compressor prefers no size (``preferred`` is
    ``None``), else ``min(DEFAULT_BUCKET_BYTES, max(preferred, ceil(B / MAX_SMALL_BUCKETS)))``
    for the ``B`` bytes of the trainable tensors of 2 or more dimensions in ``params`` (those
    compressed by default)."""
    if preferred is None:
        return DEFAULT_BUCKET_BYTES
    total = sum(p.numel() * p.element_size() for p in params if p.dim() > 1 and p.requires_grad)
    return min(DEFAULT_BUCKET_BYTES, max(preferred, math.ceil(total / MAX_SMALL_BUCKETS)))


def check_bytes(name: str, value: object, *, optional: bool = False, least: int = 0) -> None:
    """Raise ``ValueError`` naming the option ``name`` unless ``value`` is an integer >=
    ``least`` (or ``None``, where ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        allowed = f"an integer >= {least}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def build_layout(params: Sequence[Tensor], *, bucket_bytes: int, dense_bytes: int) -> Layout:
    """Split ``params`` into compressed buckets and dense per-dtype buckets.

    As DDP fills its buckets: in reverse parameter order (the order backward produces the
    gradients in, so that bucket 0 is ready first), the first bucket at most
    :data:`FIRST_BUCKET_BYTES`. The buckets are launched in key order, compressed ones first.
    """
    compressed: list[Bucket] = []
    open_: dict[torch.dtype, list[Tensor]] = {}
    used: dict[torch.dtype, int] = {}  # bytes in each dtype's open bucket
    dense: dict[torch.dtype, list[Tensor]] = {}

    def close(dtype: torch.dtype) -> None:
        members = open_.pop(dtype, [])
        used.pop(dtype, None)
        if members:
            compressed.append(Bucket(key=len(compressed), params=tuple(members), dtype=dtype))

    check_params(params)
    for p in reversed(params):  # backward produces the last layers' gradients first
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if p.dim() <= 1 or nbytes < dense_bytes:
            dense.setdefault(p.dtype, []).append(p)
            continue
        pieces = row_pieces(p, bucket_bytes)
        if len(pieces) > 1:  # too large for a bucket: pieces of their own
            close(p.dtype)
            compressed += [
                Bucket(key=len(compressed) + i, params=(p,), dtype=p.dtype, rows=rows)
                for i, rows in enumerate(pieces)
            ]
            continue
        members = open_.setdefault(p.dtype, [])
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if not compressed else bucket_bytes
        if members and used.get(p.dtype, 0) + nbytes > cap:
            close(p.dtype)
            open_[p.dtype] = [p]
            used[p.dtype] = nbytes
        else:
            members.append(p)
            used[p.dtype] = used.get(p.dtype, 0) + nbytes
    for dtype in list(open_):
        close(dtype)
    dense_buckets = tuple(
        Bucket(key=i, params=tuple(ps), dtype=dt) for i, (dt, ps) in enumerate(dense.items())
    )
    return Layout(tuple(compressed), dense_buckets, layout_signature(params))


def row_pieces(p: Tensor, bucket_bytes: int) -> list[tuple[int, int]]:
    """The rows ``start, end`` of each piece of ``p`` when it is split across buckets of at
    most ``bucket_bytes``: as few pieces as that allows, their row counts differing by at most
    one; a single piece (all rows) when ``p`` fits, or has one row (a row is never split,
    even if it alone is larger)."""
    rows = p.shape[0] if p.dim() else 1
    nbytes = p.numel() * p.element_size()
    if nbytes <= bucket_bytes or rows <= 1:
        return [(0, rows)]
    per_piece = max(1, bucket_bytes // (nbytes // rows))  # whole rows a bucket holds
    n = -(-rows // per_piece)
    base, extra = divmod(rows, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(itertools.pairwise(bounds))


def gather_grads(bucket: Bucket, flat: Tensor, plus: Tensor | None = None) -> Tensor:
    """Pack the bucket's gradients into ``flat`` (its buffer, reused across steps) and make each
    gradient a view of its piece, as DDP's ``gradient_as_bucket_view`` does: from then on
    autograd accumulates into the buffer itself and packing costs nothing, and the aggregate
    can be written back in place (no gradient-sized temporary). A gradient that is not such a
    view yet (a fresh one after ``zero_grad(set_to_none=True)``) is copied once; a missing
    one counts as zeros (and stays ``None``), and so does a sparse one, which
    :class:`gravac.GravacOptimizer` then refuses on every rank; one of another dtype than the
    bucket is cast into it, keeping its own tensor until the aggregate is written back. Every
    rank packs the same layout.

    ``plus`` (flat, ``flat``'s size and dtype) is added in the same pass: ``flat = g + plus``
    (the error-feedback residual, :meth:`gravac.engine.Engine.addend`), where a fresh gradient
    would otherwise be copied and then added to.

    Returns:
        ``flat``.
    """
    params = bucket.params
    extras: list[Tensor | None] = [None] * len(params)
    if plus is not None:
        extras = [e for _, e in split_flat(plus, params)]
    for (p, part), e in zip(split_flat(flat, params), extras, strict=True):
        g = p.grad
        if g is None or g.is_sparse:
            if e is None:
                part.zero_()
            else:
                part.copy_(e)
            continue
        if not _is_view(g, part):
            if e is None:
                part.copy_(g)
            else:
                torch.add(g, e, out=part)
                e = None
            if p.dtype == flat.dtype:
                p.grad = part
        if e is not None:
            part.add_(e)
    return flat


def scatter_grads(bucket: Bucket, flat: Tensor) -> None:
    """Give every parameter of the bucket its piece of the aggregate ``flat`` as ``p.grad``
    (nothing to do for a gradient that is already a view of it)."""
    for p, part in split_flat(flat, bucket.params):
        g = p.grad
        if g is not None and _is_view(g, part):
            continue
        if p.dtype == flat.dtype:
            p.grad = part
        elif g is None:
            p.grad = part.to(p.dtype)
        else:
            g.copy_(part)


def _is_view(g: Tensor, part: Tensor) -> bool:
    """Whether gradient ``g`` is exactly the tensor ``part`` of a bucket buffer."""
    return (
        g.data_ptr() == part.data_ptr()
        and g.dtype == part.dtype
        and g.shape == part.shape
        and g.stride() == part.stride()
    )


def join_flat(parts: Sequence[Tensor]) -> Tensor | None:
    """One flat tensor made of ``parts`` (flat, non-empty, one dtype), in order, without a
    copy: a view of their storage when they lie end to end in it, ``None`` otherwise (the
    caller then copies them together)."""
    first = parts[0]
    storage = first.untyped_storage()
    start = end = first.storage_offset()
    for t in parts:
        if t.dtype != first.dtype or t.dim() != 1 or not t.is_contiguous():
            return None
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != end:
            return None
        end += t.numel()
    if len(parts) == 1:
        return first
    return first.new_empty(0).set_(storage, start, (end - start,), (1,))


def split_flat(flat: Tensor, params: Sequence[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """Each of ``params`` with its piece of ``flat`` (in order, shaped as the parameter): the
    inverse of packing their gradients into one flat tensor."""
    offset = 0
    for p in params:
        yield p, flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()

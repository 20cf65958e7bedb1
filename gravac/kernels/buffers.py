"""Output buffers reused across steps once nobody else holds them.

A large fresh CPU tensor costs a page fault per 4 KiB page on its first write (on the machines of
``gravac bench``, a 64 MiB float32 tensor costs five times a copy into a preallocated one), and the
payloads and decompressed gradients of the 16-bit casts and PowerSGD are that size every step.
:class:`BufferPool` hands out views of buffers it keeps, and hands a buffer out again only when
every tensor it gave out on it is gone: the storage's use count (every tensor on a storage, views
included, holds one reference to it; so do NumPy arrays and DLPack capsules, through the tensor
they hold) is back to what it was when only the pool held it. A caller can therefore keep a
returned tensor as long as it likes: that buffer is simply not reused meanwhile.

Only CPU buffers are pooled: CUDA's caching allocator already makes allocations cheap, and a
buffer that an asynchronous kernel on another stream still reads has no reference to count.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["POOL_DEPTH", "BufferPool", "is_sole"]

#: Buffers tracked per (tag, dtype, device, numel), the most recently allocated: a step holds at
#: most two payloads of a bucket at once (the one at theta_min and the candidate's). When all are
#: in use a fresh one is allocated and replaces the oldest, so the pool keeps up with a caller that
#: holds on to more (a simulation of several ranks) and never keeps more than this many alive.
POOL_DEPTH = 2


#: torch's count of references to a storage (a private function: where a torch release lacks
#: it, the pool hands out fresh tensors and reuses nothing).
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _uses(storage: torch.UntypedStorage) -> int:
    """References to ``storage``: one per tensor on it (views included) and one for its Python
    object (torch keeps one per storage, which the pool holds so that the count is stable)."""
    assert _USE_COUNT is not None
    return int(_USE_COUNT(storage._cdata))


@functools.cache
def _sole_uses() -> int:
    """The use count of a storage that one tensor refers to (and its Python object, which
    :func:`is_sole` holds while it counts)."""
    probe = torch.empty(1)
    return _uses(probe.untyped_storage())


def is_sole(t: Tensor) -> bool:
    """Whether ``t`` is the only tensor on its storage (no view, other tensor or NumPy array
    shares it) and spans all of it: a caller may then take the storage over and write into it
    without anyone else seeing. ``False`` where the torch release lacks the use count."""
    if _USE_COUNT is None:
        return False
    storage = t.untyped_storage()
    whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
    return whole and _uses(storage) == _sole_uses()


class BufferPool:
    """Flat buffers keyed by ``(tag, dtype, device, numel)``, reused once released (at most
    :data:`POOL_DEPTH` tracked per key).

    :meth:`empty` returns a fresh alias (a view) of a pooled buffer; the buffer itself never
    leaves the pool, so its storage's use count exceeds the count taken when it was allocated
    exactly while some returned tensor, or a view of one, is alive.
    """

    def __init__(self) -> None:
        # per key: the buffers, each with its storage and the storage's use count when only the
        # pool held it
        self._buffers: dict[tuple[object, ...], list[tuple[Tensor, torch.UntypedStorage, int]]]
        self._buffers = {}

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, tag: object) -> Tensor:
        """A flat uninitialised tensor that no tensor alive shares memory with; ``tag`` keeps
        apart buffers of the same size used for different purposes (payload, output)."""
        if device.type != "cpu" or _USE_COUNT is None:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (tag, dtype, device, numel)
        slots = self._buffers.setdefault(key, [])
        for buffer, storage, alone in slots:
            if _uses(storage) == alone:
                return buffer.view(numel)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        storage = buffer.untyped_storage()
        slots.append((buffer, storage, _uses(storage)))
        del slots[:-POOL_DEPTH]  # the oldest is no longer tracked (its holder still has it)
        return buffer.view(numel)

    def clear(self) -> None:
        """Drop every buffer (their memory is freed once returned tensors are gone)."""
        self._buffers.clear()

    def drop(self, tag: object) -> None:
        """Drop the buffers of ``tag`` (freed once returned tensors are gone)."""
        self._buffers = {k: v for k, v in self._buffers.items() if k[0] != tag}

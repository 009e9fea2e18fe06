"""The static KV cache: one preallocated row per decode slot, and the slot allocator.

Keys and values of layer l live in `keys[l]` / `values[l]`, each
[decode_slots, kv_heads, max_context, head_dim] on the device, allocated once at load: no
step ever allocates or reshapes the cache, so every step has the same shapes. A compiled
prefill writes its slot's row whole (the prompt, zero-padded to max_context), an eager mixed
step the prompt's positions; a decode step writes one position per slot. Positions past a
slot's length hold stale values that attention masks.

Slots are handed out lowest-first, so the running requests sit in the leading rows: a
compiled decode step of width n (a decode bucket) covers rows [0, n), an eager one attends
over rows up to the highest slot in use.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int


class StaticKVCache:
    def __init__(
        self, shape: CacheShape, slots: int, max_context: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        dims = (slots, shape.kv_heads, max_context, shape.head_dim)
        self.shape = shape
        self.slots = slots
        self.max_context = max_context
        self.keys = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class SlotAllocator:
    """Free slots, lowest first."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))
        heapq.heapify(self._free)
        self.used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        slot = heapq.heappop(self._free)
        self.used.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        self.used.remove(slot)
        heapq.heappush(self._free, slot)

    def width(self) -> int:
        """Rows a decode step must cover: up to the highest slot in use."""
        return max(self.used) + 1 if self.used else 0

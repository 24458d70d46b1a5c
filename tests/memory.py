"""Peak-memory measurement of CPU tensors created inside a block (test-only).

A TorchDispatchMode sees every tensor an op returns; bytes are counted per storage from its first
tensor until its last tensor is collected, so the peak is that of the live intermediate tensors.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, live tensors]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            if key not in self._storages:
                self._storages[key] = [storage.nbytes(), 0]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            self._storages[key][1] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]

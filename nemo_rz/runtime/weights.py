"""Versioned weights shared with local rollout processes through shared memory (no files, no pickling).

A ring of `slots` state-dict buffers: version v lives in slot v % slots until version v + slots replaces
it. With slots = max_lag + 1 a version is never overwritten while a job may still need it, because the
learner cannot publish v + max_lag + 1 before it has consumed the batch generated from v.
"""
from __future__ import annotations

import torch


class SharedWeightRing:
    def __init__(self, state_dict: dict[str, torch.Tensor], slots: int):
        self.slots = slots
        self.buffers = [{k: v.detach().clone().share_memory_() for k, v in state_dict.items()} for _ in range(slots)]
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        slot = version % self.slots
        self.versions[slot] = -1  # a reader never sees a half-written slot as valid
        with torch.no_grad():
            for k, v in state_dict.items():
                self.buffers[slot][k].copy_(v)
        self.versions[slot] = version

    def read(self, version: int) -> dict[str, torch.Tensor]:
        slot = version % self.slots
        found = int(self.versions[slot])
        if found != version:
            raise RuntimeError(f"weight version {version} is not in the shared ring (slot {slot} holds {found})")
        return self.buffers[slot]

"""Versioned weights: what a version ships (WeightsBundle), and the ring that shares versions with local rollout
processes through shared memory (no files, no pickling).

A ring of `slots` state-dict buffers: version v lives in slot v % slots until version v + slots replaces
it. With slots = max_lag + 1 a version is never overwritten while a job may still need it, because the
learner cannot publish v + max_lag + 1 before it has consumed the batch generated from v.
"""
from __future__ import annotations

import dataclasses

import torch

# The parts a bundle may carry beside the policy; no Hugging Face policy tensor name starts with one of them.
PARTS = ("draft",)


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


@dataclasses.dataclass(frozen=True)
class WeightsBundle:
    """What one weight version ships: the policy's weights (Hugging Face names) and the weights of each part that
    travels with them (a co-trained draft's, under "draft"; later LoRA adapters), by part name. Engines take it
    whole (`RolloutEngine.update_weights(bundle.policy, version, bundle.parts)`), so no module splits state dicts.

    `flat()` is its one serialized form, for shared memory, Ray's object store and checkpoint files: a part's
    tensors under "<part>.<name>" beside the policy's (so checkpoints written before bundles existed read back the
    same); `from_flat` reads it back.
    """

    version: int
    policy: dict[str, torch.Tensor]
    parts: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def flat(self) -> dict[str, torch.Tensor]:
        out = dict(self.policy)
        for part, weights in self.parts.items():
            if part not in PARTS:
                raise ValueError(f"weights bundle: unknown part {part!r} (known: {', '.join(PARTS)})")
            out.update({f"{part}.{k}": v for k, v in weights.items()})
        return out

    @classmethod
    def from_flat(cls, state: dict[str, torch.Tensor], version: int) -> "WeightsBundle":
        policy, parts = {}, {}
        for k, v in state.items():
            part, _, name = k.partition(".")
            if part in PARTS:
                parts.setdefault(part, {})[name] = v
            else:
                policy[k] = v
        return cls(version, policy, parts)

    def to(self, dtype: torch.dtype) -> "WeightsBundle":
        """The same bundle with floating-point tensors in `dtype` (a rollout engine's)."""
        def cast(d):
            return {k: v.to(dtype) if v.is_floating_point() else v for k, v in d.items()}
        return WeightsBundle(self.version, cast(self.policy), {p: cast(w) for p, w in self.parts.items()})

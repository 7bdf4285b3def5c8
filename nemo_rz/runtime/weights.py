"""Versioned weights: what a version ships (WeightsBundle), and the ring that shares versions with local rollout
processes through shared memory (no files, no pickling).

A ring of `slots` state-dict buffers: version v lives in slot v % slots until version v + slots replaces
it. With slots = max_lag + 1 a version is never overwritten while a job may still need it, because the
learner cannot publish v + max_lag + 1 before it has consumed the batch generated from v.
"""
from __future__ import annotations

import dataclasses

import torch

from nemo_rz.models.lora import is_adapter

# The parts a bundle may carry beside the policy; no Hugging Face policy tensor name starts with one of them.
PARTS = ("draft",)


class SharedWeightRing:
    """`static`: names of tensors that are the same in every version (a LoRA base under its adapters): held once,
    in one buffer every slot shares, and never written again by publish (a version ships the rest alone)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], slots: int, static=()):
        self.slots, self.static = slots, frozenset(static)
        shared = {k: state_dict[k].detach().clone().share_memory_() for k in self.static}
        self.buffers = [{k: shared[k] if k in shared else v.detach().clone().share_memory_() for k, v in state_dict.items()}
                        for _ in range(slots)]
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Write version `version` into its slot; returns the bytes written (the static tensors are not)."""
        slot = version % self.slots
        self.versions[slot] = -1  # a reader never sees a half-written slot as valid
        written = 0
        with torch.no_grad():
            for k, v in state_dict.items():
                if k not in self.static:
                    self.buffers[slot][k].copy_(v)
                    written += v.numel() * v.element_size()
        self.versions[slot] = version
        return written

    def read(self, version: int) -> dict[str, torch.Tensor]:
        slot = version % self.slots
        found = int(self.versions[slot])
        if found != version:
            raise RuntimeError(f"weight version {version} is not in the shared ring (slot {slot} holds {found})")
        return self.buffers[slot]


@dataclasses.dataclass(frozen=True)
class WeightsBundle:
    """What one weight version ships: the policy's weights (Hugging Face names) and the weights of each part that
    travels with them (a co-trained draft's, under "draft"), by part name. A LoRA model's adapters are policy tensors
(`...q_proj.lora_A.weight`); its base is the same in every version, and back-ends ship it once (`static_names`). Engines take it
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

    def static_names(self) -> list[str]:
        """The flat names that are the same in every version: a LoRA policy's base (every policy tensor but the
        adapters'); none for a model without adapters."""
        if not any(is_adapter(k) for k in self.policy):
            return []
        return [k for k in self.policy if not is_adapter(k)]

    def to(self, dtype: torch.dtype) -> "WeightsBundle":
        """The same bundle with floating-point tensors in `dtype` (a rollout engine's); LoRA adapter tensors stay
        float32, as the adapters are whatever the base's dtype (models/lora.py)."""
        def cast(d):
            return {k: v.to(dtype) if v.is_floating_point() and not is_adapter(k) else v for k, v in d.items()}
        return WeightsBundle(self.version, cast(self.policy), {p: cast(w) for p, w in self.parts.items()})

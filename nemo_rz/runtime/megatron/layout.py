"""The Megatron learner's process layout: how many ranks split the model along each axis.

world = tp x pp x cp x dp processes. Tensor parallelism (tp) splits heads and features, pipeline parallelism
(pp) splits the layers into stages, context parallelism (cp) splits each packed sequence's tokens, data
parallelism (dp) splits the batch's rows. Expert parallelism (ep) adds no process: as in Megatron, a mixture
of experts' layer splits its experts over ep of the dp x cp ranks of one tensor-parallel slice. `grad_shares`
fixes how many equal slices of rows the batch is cut into for gradients (data_parallel.py), whatever dp is.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    grad_shares: int | None = None  # None: dp

    def __post_init__(self):
        for axis in ("tp", "pp", "cp", "ep", "dp"):
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"megatron.{axis} = {v!r}: must be a positive integer")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"megatron.ep = {self.ep}: experts are split over data- and context-parallel ranks, so ep "
                             f"must divide megatron.dp x megatron.cp = {self.dp * self.cp}; raise megatron.dp")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def shares(self) -> int:
        return self.grad_shares or self.dp

    def to_dict(self) -> dict:
        return dict(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp=self.dp, grad_shares=self.shares)

    @classmethod
    def from_section(cls, m) -> "Layout":
        """From the typed config's `megatron` section (nemo_rz.schema.typed)."""
        return cls(m.tp, m.pp, m.cp, m.ep, m.dp, m.grad_shares)

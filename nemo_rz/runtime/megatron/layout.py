"""The Megatron learner's process layout: how many ranks split the model along each axis.

world = tp x pp x cp x dp processes. Tensor parallelism (tp) splits heads and features, pipeline parallelism
(pp) splits the layers into stages, context parallelism (cp) splits each packed sequence's tokens, data
parallelism (dp) splits the batch's rows. Expert parallelism (ep) adds no process: as in Megatron, a mixture
of experts' layer splits its experts over ep of the dp x cp ranks of one tensor-parallel slice, so ep must
divide dp x cp; the config's megatron.dp defaults to null, the fewest data-parallel ranks ep needs (ep / gcd(ep,
cp), said on stderr: `megatron.ep=2` alone runs dp=2, 2 processes), derived in one place, schema.data_parallel_size
(a Layout's dp is always a number; an explicit dp that ep does not divide is refused here). `grad_shares`
fixes how many equal slices of rows the batch is cut into for gradients (data_parallel.py), whatever dp is.
`device` is where each rank computes: "cpu" (gloo; the default, and what the tests run) or "cuda" (rank r on
cuda:LOCAL_RANK, NCCL for CUDA tensors: distributed.placement).
"""
from __future__ import annotations

import dataclasses
import itertools

DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    grad_shares: int | None = None  # None: dp
    device: str = "cpu"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"megatron.device = {self.device!r}: expected one of {', '.join(DEVICES)}")
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
        """The axes (what an optimizer state's sharding depends on; not the device, which a resume may change)."""
        return dict(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp=self.dp, grad_shares=self.shares)

    @classmethod
    def from_section(cls, m) -> "Layout":
        """From the typed config's `megatron` section (nemo_rz.schema.typed)."""
        return cls(m.tp, m.pp, m.cp, m.ep, m.dp, m.grad_shares, m.device)


def layouts_of(world: int, axes: tuple[str, ...] = ("tp", "pp", "cp", "dp"), sizes: tuple[int, ...] = (1, 2),
               refused: tuple[str, ...] = ()) -> dict[str, Layout]:
    """Every Layout of `world` processes with each of `axes` in `sizes` (the others 1), leaving out those with an
    axis of `refused` above 1; named like "tp2_dp2" (axes above 1 only). grad_shares = dp (the matrix test's and
    the benchmark's list: tests/test_megatron_layouts.py, benchmarks/megatron_layouts.py)."""
    found = {}
    for combo in itertools.product(sizes, repeat=len(axes)):
        chosen = dict(zip(axes, combo))
        if any(chosen[a] > 1 for a in refused if a in chosen):
            continue
        if "ep" in chosen and (chosen.get("dp", 1) * chosen.get("cp", 1)) % chosen["ep"]:
            continue
        layout = Layout(**chosen)
        if layout.world == world:
            found["_".join(f"{a}{v}" for a, v in chosen.items() if v > 1) or "one"] = layout
    return found

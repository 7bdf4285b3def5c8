"""The Megatron learner: runtime.Learner's loss and update (the same code) on a Megatron GPTModel, over
the processes of a Layout (layout.py): tensor, pipeline (Megatron's schedule, schedule.py) and data parallel.

Rank 0 runs the trainer and drives the learner; with more than one process, every learner call on rank 0 is
first sent to the other ranks (`collective`), which run the same call on their part of the model (`serve`):
the model's collectives then pair up. What differs from the built-in learner is only what tensor parallelism
changes: the gradient norm and the weight norm are sums over the ranks' shards and stages (each tensor's square
in the whole model's order, so the sum is PP=1's), qk-norm weights (shared by heads that live on different
ranks) get their gradients summed over the ranks, and the optimizer state is one per rank. A Decoder (`mirror`)
on rank 0 follows every update, for held-out evaluation with the built-in engine.

Auxiliary losses (a co-trained draft) run on rank 0 through runtime.Learner's hook: `add_aux_loss` learns which
points of the model the loss taps and has every rank tap them in the RL forward (taps.py); under context
parallelism every context-parallel rank of tensor-parallel rank 0 runs a copy of them on its own tokens.
"""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist

from nemo_rz import schema
from nemo_rz.errors import DivergenceError
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.parallel.tensor import all_gather_sum
from nemo_rz.runtime.learner import MAX_WEIGHT_GROWTH, Learner
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.data_parallel import DataParallel
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.model import MegatronPolicy
from nemo_rz.runtime.megatron.precision import apply_precision
from nemo_rz.runtime.megatron.taps import Lent, Taps, TapView

_SHARED_ACROSS_HEADS = ("q_layernorm", "k_layernorm")  # replicated weights applied to each rank's own heads
PEER_LOSS_GRACE_S = 10.0


def collective(method):
    """On rank 0 of a multi-process learner, send the call to the other ranks before running it."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not self.commanding:
            return method(self, *args, **kwargs)
        self.commanding = False  # calls made inside this one are not sent again
        try:
            dist.broadcast_object_list([(method.__name__, args, kwargs)], src=0)
            return method(self, *args, **kwargs)
        except RuntimeError:
            # A rank that died breaks the collectives here first. The launcher has seen it die and is stopping
            # this process, to report it in one line: give it that time before reporting an error of our own.
            time.sleep(PEER_LOSS_GRACE_S)
            raise
        finally:
            self.commanding = True

    return run


class MegatronLearner(Learner):
    def __init__(self, mirror: Decoder | None, layout: Layout, lr: float, grad_clip: float | None, temperature: float,
                 loss: str, correction: str, correction_params: dict, seed: int = 0, precision: dict | None = None,
                 _init: tuple | None = None):
        distributed.init(layout, seed)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        args = (layout, lr, grad_clip, temperature, loss, correction, dict(correction_params), seed, precision)
        if _init is None:  # rank 0: the model's config and first weights come from the mirror
            _init = (mirror.config.to_dict(), mirror.state_dict())
            if self.world > 1:
                dist.broadcast_object_list([(args, _init)], src=0)
        config, weights = _init
        policy = MegatronPolicy(DecoderConfig.from_dict(config))
        policy.load_state_dict(weights)
        apply_precision(policy, precision)  # the recipe the mirror and the rollout engines run (precision.py)
        self.tp_group, self.pp_group = distributed.tp_group(), policy.pp_group
        model = DataParallel(policy, layout.shares, distributed.dp_group())
        super().__init__(model, lr, grad_clip, temperature, loss, correction, correction_params)
        self.mirror, self.layout = mirror, layout.to_dict()
        self.commanding = self.rank == 0 and self.world > 1
        self._tap_group = None
        self.sharded, self.replicated, self.head_shared = [], [], []
        for name, p in policy.stage_parameters():
            kind = self.sharded if getattr(p, "tensor_model_parallel", False) else self.replicated
            kind.append(p)
            if any(s in name for s in _SHARED_ACROSS_HEADS):
                self.head_shared.append(p)

    @classmethod
    def follow(cls) -> "MegatronLearner":
        """A rank other than 0: build this rank's part from rank 0's first message, then run rank 0's calls
        until it says stop; returns this rank's learner. An error rank 0 also meets (divergence, bad input) is
        rank 0's to report."""
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        args, init = msg[0]
        learner = cls(None, *args, _init=init)
        while True:
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                return learner
            name, a, kw = msg[0]
            try:
                getattr(learner, name)(*a, **kw)
            except (DivergenceError, ValueError):
                pass

    def stop(self) -> None:
        """Release the other ranks (rank 0, at the end of the job)."""
        if self.commanding:
            self.commanding = False
            dist.broadcast_object_list([None], src=0)

    # -- auxiliary losses (rank 0) --------------------------------------------------------------------
    def add_aux_loss(self, loss) -> None:
        """Register `loss` (rank 0) and have every rank tap, in the RL forward, the points it reads."""
        super().add_aux_loss(loss)
        self._retap()

    @Learner.draft.setter
    def draft(self, trainer) -> None:
        Learner.draft.fset(self, trainer)
        self._retap()

    def _retap(self) -> None:
        context = self.model.policy.context
        if self.model.aux_target is None:
            self.model.aux_target = TapView(self.mirror, self.model.config.num_layers,
                                            None if context is None else context.group)
        view = self.model.aux_target
        points = tuple(sorted({p for a in self.aux_losses for p in view.points_of(a)}))
        # Under context parallelism the other consumers train copies of the losses on their own tokens (taps.py).
        self._set_taps(points, *((tuple(self.aux_losses), Lent(self.mirror)) if context is not None and points else ()))

    @collective
    def _set_taps(self, points: tuple[int, ...], losses: tuple = (), lent: Lent | None = None) -> None:
        if points and distributed.device().type != "cpu":
            raise ValueError(f"megatron.device = {distributed.device().type} with an auxiliary loss (a co-trained "
                             "draft): the tap channel gathers CPU features over gloo; use megatron.device=cpu")
        if self._tap_group is None:  # the tap channel's own group (every rank creates it, in this call)
            self._tap_group = dist.new_group(backend="gloo")
        self.model.taps = Taps(self.model.policy, points, self.model.per_rank, self._tap_group) if points else None
        if self.rank != 0:  # a context-parallel consumer's copies of rank 0's losses, or none
            consumer = self.model.taps is not None and self.model.taps.consumer
            self.aux_losses = list(losses) if consumer else []
            self.model.aux_target = TapView(lent, self.model.config.num_layers, self.model.policy.context.group) if consumer else None

    def receive(self, bundle) -> None:
        """The auxiliary losses take back their parts of a restored version (their copies too)."""
        self._receive_parts({a.name: bundle.parts[a.name] for a in self.aux_losses if a.name in bundle.parts})

    @collective
    def _receive_parts(self, parts: dict) -> None:
        for a in self.aux_losses:
            if a.name in parts:
                a.receive(parts[a.name])

    # -- the calls rank 0 sends -----------------------------------------------------------------------
    @collective
    def rl_step(self, batch, advantages, what: str = "RL update"):
        taps = self.model.taps
        if taps is not None:  # the RL forward feeds the auxiliary losses (the other calls' forwards do not)
            taps.active = True
        try:
            return super().rl_step(batch, advantages, what)
        finally:
            if taps is not None:
                taps.active = False

    @collective
    def gradients(self) -> dict[str, torch.Tensor]:
        """The last update's gradients, whole tensors in Hugging Face names (every rank takes part)."""
        return self.model.policy.whole(lambda p: p.grad)

    @collective
    def sft_step(self, ids, lengths, target_mask, what: str = "warm-up"):
        return super().sft_step(ids, lengths, target_mask, what)

    @collective
    def decompose(self, batch, weights_at_rollout, current_lp=None):
        return super().decompose(batch, weights_at_rollout, current_lp)

    @collective
    def state_dict_copy(self) -> dict[str, torch.Tensor]:
        return super().state_dict_copy()

    @collective
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Whole Hugging Face-named weights (a checkpoint being resumed)."""
        self.model.load_state_dict(state)
        self._follow_mirror()

    @collective
    def _new_optimizer(self, lr: float) -> None:
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def supervised(self, lr: float):
        return _Supervised(self, lr)

    @collective
    def optimizer_state(self) -> dict:
        """Every rank's optimizer state (each holds its own shards' moments), with the layout they belong to."""
        ranks = [None] * self.world
        on_cpu = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, self.opt.state_dict())
        dist.all_gather_object(ranks, on_cpu)
        return dict(megatron=self.layout, ranks=ranks, **{a.name: a.state_dict() for a in self.aux_losses})

    @collective
    def load_optimizer_state(self, state: dict, lr: float) -> None:
        saved = state.get("megatron")
        if saved is not None:
            saved = {"cp": 1, "ep": 1, **saved}  # saved before the layout had these axes
        if saved != self.layout:
            saved = state.get("megatron") or "the built-in learner"
            raise ValueError(f"the checkpoint's optimizer state was saved by {saved}, not by the Megatron learner with "
                             f"{self.layout}; resume with the layout it was saved with")
        aux = {a.name: state[a.name] for a in self.aux_losses if a.name in state}  # rank 0's auxiliary losses
        super().load_optimizer_state({**state["ranks"][self.rank], **aux}, lr)

    # -- the update, with norms over the tensor-parallel shards --------------------------------------------
    def _norm(self, tensors_sharded, tensors_replicated) -> float:
        """L2 norm over the whole model: every rank's shards, the replicated tensors once (float64 squares, summed
        in the whole model's order: the stages' in stage order)."""
        squares = [[torch.linalg.vector_norm(t.detach(), dtype=torch.float64) ** 2 for t in tensors_sharded], []]
        if dist.get_rank(self.tp_group) == 0:
            squares[1] = [torch.linalg.vector_norm(t.detach(), dtype=torch.float64) ** 2 for t in tensors_replicated]
        if dist.get_world_size(self.pp_group) > 1:
            stages = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, squares, group=self.pp_group)
            squares = [[v for stage in stages for v in stage[kind]] for kind in (0, 1)]
        sq = torch.zeros((), dtype=torch.float64, device=distributed.device())
        for v in squares[0] + squares[1]:
            sq += v
        return math.sqrt(float(all_gather_sum(sq.reshape(1), self.tp_group)))

    def _grads(self, params):
        return [p.grad for p in params if p.grad is not None]

    def _apply(self, loss: torch.Tensor, what: str) -> float:
        if not torch.isfinite(loss):
            raise DivergenceError(f"{what}: loss is {loss.item()}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if dist.get_world_size(self.tp_group) > 1:
            for p in self.head_shared:
                if p.grad is not None:
                    p.grad = all_gather_sum(p.grad.unsqueeze(0), self.tp_group)
        norm = self._norm(self._grads(self.sharded), self._grads(self.replicated))
        if not math.isfinite(norm):
            raise DivergenceError(f"{what}: gradient norm is {norm}")
        if self.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.grad_clip, torch.tensor(norm))
        if norm > 0:  # as the built-in learner: no signal, no step
            before = self._norm(self.sharded, self.replicated)
            self.opt.step()
            after = self._norm(self.sharded, self.replicated)
            if not math.isfinite(after):
                raise DivergenceError(f"{what}: weights are not finite after the step (norm {after})")
            if before > 0 and after > MAX_WEIGHT_GROWTH * before:
                raise DivergenceError(f"{what}: weight norm grew from {before:.3g} to {after:.3g} in one step "
                                      f"(more than {MAX_WEIGHT_GROWTH:g}x)")
            self._follow_mirror()
        return norm

    def _follow_mirror(self) -> None:
        weights = self.model.state_dict()  # a collective: every rank takes part
        if self.mirror is not None:
            self.mirror.load_state_dict(weights)
        elif self.model.aux_target is not None:  # a context-parallel consumer's copy of what its losses read
            self.model.aux_target.mirror.follow(weights)


class _Supervised:
    """Learner.supervised for the Megatron learner: the optimizer swaps are sent to every rank."""

    def __init__(self, learner: MegatronLearner, lr: float):
        self.learner, self.lr = learner, lr

    def __enter__(self):
        self.learner._new_optimizer(self.lr)

    def __exit__(self, *exc):
        self.learner._new_optimizer(self.learner.lr)
        return False


def from_config(m: schema.MegatronSection, a: schema.AlgoSection, seed: int, mirror: Decoder,
                precision: dict | None = None) -> MegatronLearner:
    """The learner that `runtime.learner=megatron` asks for, from the `megatron` and `algo` sections of the typed
    config (nemo_rz.schema.typed), starting from `mirror`'s weights (rank 0 of the job), its linears at `precision`
    (the `precision.*` the mirror and the rollout engines run). LoRA is refused: the Megatron layers carry no adapters."""
    if getattr(mirror, "lora_spec", None) is not None:
        raise ValueError("lora.rank > 0: LoRA runs on the built-in learner only (the Megatron learner's layers carry "
                         "no adapters yet); use runtime.learner=builtin or lora.rank=0")
    return MegatronLearner(mirror, Layout.from_section(m), a.lr, a.grad_clip, a.temperature, a.loss, a.correction,
                           a.correction_params, seed=seed, precision=precision)

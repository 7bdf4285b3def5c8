"""NeMo RL's Megatron policy with nemo-rz's output layer and log-softmax: the two steps of the loss's logprobs
that the consistent layer spec (bridge.py) does not reach.

The log-softmax: NeMo RL's loss protocol lets a loss ask for the model's logits (`input_type = LossInputType.LOGIT`;
nemo_rl/algorithms/loss/utils.py, prepare_loss_input, hands them over as `logits=`) instead of NeMo RL's logprobs
(nemo_rl/distributed/model_utils.py, from_parallel_logits_to_logprobs: a log-softmax over the tensor-parallel
shards, max and exp-sum all-reduced). `VocabParallelLogprobs` is what ReinforceZeroLossFn computes its logprobs
with then (nemo_rz/algorithms/nemo_rl.py, `logprobs_from_logits`): the Megatron output's vocabulary shards
[B, S, V_padded / tp] gathered in rank order (so the columns are the vocabulary in the rollout engine's order,
each logit's bits copied, nothing summed across ranks), the padding columns dropped, and ops.token_logprobs over
the whole vocabulary; so a tensor-parallel size gives the bits of one rank, and the bits of the built-in Decoder's
token_logprobs (ops.lm_head_logprobs is those two ops, row by row).

The output layer: the GPTModel builds Megatron's ColumnParallelLinear itself (no layer spec reaches it), and
NeMo RL's Megatron setup (nemo_rl/models/megatron/setup.py, `setup_model_and_optimizer`) takes extra pre-wrap
hooks only as an argument (`additional_pre_wrap_hooks`, NeMo RL v0.7 and later) that its Megatron policy worker
does not pass. `install_output_layer` is the one place that changes NeMo RL: it wraps that function, in
nemo_rl.models.megatron.setup and in the worker module that imported it, so that its hooks include
bridge.consistent_output_layer (Megatron's output layer replaced by layers.ColumnLinear, ops.linear, before the
DDP wrap). It checks the function's signature first and refuses, in one line, a NeMo RL whose function takes no
such argument. bridge.py calls it when imported in a process that has NeMo RL loaded (in NeMo RL's Megatron
workers: when Ray unpickles the policy config that holds consistent_layer_spec, before the worker builds its
model).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch

from nemo_rz import ops
from nemo_rz.errors import NeMoRLVersionError
from nemo_rz.parallel.tensor import gather_last

SETUP_MODULE = "nemo_rl.models.megatron.setup"
WORKER_MODULE = "nemo_rl.models.policy.workers.megatron_policy_worker"
# setup_model_and_optimizer's parameters the wrapper relies on (NeMo RL v0.7.0 and main of 2026-08-22)
SETUP_PARAMS = ("policy_cfg", "megatron_cfg", "additional_pre_wrap_hooks")


def _tp_group():
    """Megatron's tensor-parallel group; None (one rank) where this process built no Megatron groups."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None


def _cp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


@dataclasses.dataclass(frozen=True)
class VocabParallelLogprobs:
    """logits [B, S', V_padded / tp] (this rank's vocabulary shard of a GPTModel's output, S' >= S), input_ids
    [B, S] -> [B, S-1] float32 logprobs of input_ids[:, 1:] (nemo-rz's arithmetic, the same on every rank).
    `vocab_size`: the model's real vocabulary (the checkpoint's config; Megatron pads it to a multiple)."""
    vocab_size: int

    def __post_init__(self):
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"VocabParallelLogprobs: vocab_size = {self.vocab_size!r}; pass the model's vocabulary "
                             "size (its config's vocab_size)")

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor, group=None) -> torch.Tensor:
        if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[0] != input_ids.shape[0] \
                or logits.shape[1] < input_ids.shape[1]:
            raise ValueError(f"VocabParallelLogprobs: logits {tuple(logits.shape)} and input_ids "
                             f"{tuple(input_ids.shape)} must be [B, S' >= S, vocab shard] and [B, S]; pass the "
                             "Megatron model's output for these tokens")
        if _cp_size() != 1:
            raise ValueError(f"VocabParallelLogprobs: context parallel size {_cp_size()}: the logits hold this rank's "
                             "tokens only; set policy.megatron_cfg.context_parallel_size=1")
        group = _tp_group() if group is None else group
        b, s = input_ids.shape
        full = gather_last(logits[:, : s - 1], group)  # the shards in rank order: the vocabulary in order
        if full.shape[-1] < self.vocab_size:
            raise ValueError(f"VocabParallelLogprobs: the logits cover {full.shape[-1]} vocabulary entries over the "
                             f"tensor-parallel ranks, fewer than vocab_size = {self.vocab_size}; pass the model's "
                             "real vocabulary size")
        rows = full[..., : self.vocab_size].reshape(b * (s - 1), self.vocab_size)
        with ops.use_kernels("consistent"):
            lp = ops.token_logprobs(rows, input_ids[:, 1:].reshape(-1), 1.0)
        return lp.view(b, s - 1)


def _check_signature(fn) -> None:
    params = inspect.signature(fn).parameters
    missing = [p for p in SETUP_PARAMS if p not in params]
    if missing:
        raise NeMoRLVersionError(
            f"{SETUP_MODULE}.setup_model_and_optimizer{inspect.signature(fn)} takes no {', '.join(missing)}: this "
            "NeMo RL's Megatron policy cannot be given nemo-rz's output layer (NeMo RL v0.7.0 and main of 2026-08-22 "
            "can); use such a NeMo RL, or NeMo RL's stock layer spec")


def with_output_layer(setup_fn, hook):
    """`setup_fn` (NeMo RL's setup_model_and_optimizer) with `hook` appended to its additional_pre_wrap_hooks."""
    if getattr(setup_fn, "_nemo_rz_output_layer", False):
        return setup_fn
    _check_signature(setup_fn)

    @functools.wraps(setup_fn)
    def setup_model_and_optimizer(*args, **kwargs):
        bound = inspect.signature(setup_fn).bind(*args, **kwargs)
        hooks = list(bound.arguments.get("additional_pre_wrap_hooks") or [])
        bound.arguments["additional_pre_wrap_hooks"] = [*hooks, hook]
        return setup_fn(*bound.args, **bound.kwargs)

    setup_model_and_optimizer._nemo_rz_output_layer = True
    return setup_model_and_optimizer


def install_output_layer(modules=None) -> bool:
    """Have NeMo RL's Megatron setup apply bridge.consistent_output_layer to every model it builds: its setup
    module's setup_model_and_optimizer and the Megatron policy worker module's imported name, where this process has
    loaded them (a Ray worker loads the actor's module before it unpickles the actor's arguments, the policy config
    that imports bridge.py). False where neither is loaded (the driver: it builds no model); True once installed.
    `modules` ({name: module}, default sys.modules) is for tests."""
    from nemo_rz.runtime.megatron import bridge

    modules = sys.modules if modules is None else modules
    found = [m for m in (modules.get(SETUP_MODULE), modules.get(WORKER_MODULE))
             if m is not None and hasattr(m, "setup_model_and_optimizer")]
    for m in found:
        m.setup_model_and_optimizer = with_output_layer(m.setup_model_and_optimizer, bridge.consistent_output_layer)
    return bool(found)


def check_output_layer(modules=None) -> None:
    """Refuse, in one line, to build the consistent spec inside a NeMo RL Megatron setup that install_output_layer
    did not reach (the model would get Megatron's output layer, silently)."""
    modules = sys.modules if modules is None else modules
    for name in (SETUP_MODULE, WORKER_MODULE):
        fn = getattr(modules.get(name), "setup_model_and_optimizer", None)
        if fn is not None and not getattr(fn, "_nemo_rz_output_layer", False):
            raise NeMoRLVersionError(f"consistent_layer_spec: {name}.setup_model_and_optimizer was loaded after "
                                     "nemo_rz.runtime.megatron.bridge and does not apply nemo-rz's output layer; "
                                     "import nemo_rz.runtime.megatron.bridge after NeMo RL's Megatron policy worker")

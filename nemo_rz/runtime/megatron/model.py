"""A megatron-core GPTModel built from a DecoderConfig, with the built-in Decoder's interface for the learner:
`token_logprobs`, and `state_dict` / `load_state_dict` in Hugging Face names (whole tensors, what the rollout
engines load).

Under pipeline parallelism (schedule.py) each rank holds one stage: the GPTModel of its layers (Megatron's
`pre_process` on the first stage, `post_process` on the last), whose layer numbers count across stages (the
layers read their global index); state_dict and load_state_dict still speak the whole model, every rank taking
part. A tied output layer on a last stage that is not the first holds its own copy of the embedding (its
gradient is summed with the embedding's per micro-batch, data_parallel.py).

Two layer specs (spec.py): `consistent` (the kernel set's default) puts nemo_rz.ops inside every Megatron submodule
(layers.py), so the logprobs equal the built-in Decoder's and the rollout engines' bit for bit, and equal at
every tensor-parallel size; `fast` is Megatron's own local spec (its column/row-parallel layers with their
all-reduce, torch RMSNorm, DotProductAttention, vocab-parallel cross-entropy): the standard path to compare with.

Placement (distributed.placement): the policy is built on the CPU and its parameters then moved to the rank's
device, `distributed.device()` (cuda:LOCAL_RANK with megatron.device=cuda); token_logprobs moves its inputs there
and hands the logprobs back on the caller's device, and state_dict / whole give CPU tensors (what the rollout
engines and checkpoints load). The layers build every other tensor on their input's device. Megatron's pipeline
schedule and the context-parallel token layout still build CPU tensors of their own, so megatron.device=cuda refuses
pp > 1 and cp > 1.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Tokens, prepared
from nemo_rz.parallel.tensor import gather_last, gather_parts
from nemo_rz.runtime.megatron import context, convert, distributed, layers, moe, spec

# Megatron's own tensor-parallel layers advise, at their first forward, a CUDA stream setting: moot here.
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

def zero_outside(lp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """lp with 0 where `mask` (the same [B, T-1]) is 0; lp itself without a mask."""
    if mask is None:
        return lp
    return torch.where(mask.to(lp.device) != 0, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


class MegatronPolicy(nn.Module):
    """GPTModel over this process's tensor-parallel group (built in the kernel set current at construction)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.fast = ops.get_kernels() != "consistent"
        spec.check_supported(cfg, self.fast)
        self.device = distributed.device()  # every parameter and input of this policy is moved there, and only there
        self.config, self.tp = cfg, distributed.tp_group()
        self.tp_size, self.tp_rank = dist.get_world_size(self.tp), dist.get_rank(self.tp)
        self.padded_vocab = -(-cfg.vocab_size // self.tp_size) * self.tp_size  # Megatron splits the vocabulary evenly
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size, self.pp_rank = dist.get_world_size(self.pp_group), dist.get_rank(self.pp_group)
        cp = parallel_state.get_context_parallel_world_size()
        if self.device.type != "cpu" and (self.pp_size > 1 or cp > 1):
            axis, size = ("pp", self.pp_size) if self.pp_size > 1 else ("cp", cp)
            raise ValueError(f"megatron.device = {self.device.type} with megatron.{axis} = {size}: the pipeline schedule "
                             "and the context-parallel token layout still build CPU tensors; use megatron.device=cpu or "
                             f"megatron.{axis}=1")
        if cfg.num_layers % self.pp_size:
            raise ValueError(f"megatron.pp = {self.pp_size} does not divide the model's {cfg.num_layers} layers; "
                             "choose a pp that divides them")
        per_stage = cfg.num_layers // self.pp_size
        moe_stages = {any(cfg.is_moe(i) for i in range(s * per_stage, (s + 1) * per_stage)) for s in range(self.pp_size)}
        if len(moe_stages) > 1:
            raise ValueError(f"megatron.pp = {self.pp_size}: a pipeline stage without a mixture-of-experts layer cannot "
                             "take part in the routing record over stages; choose a pp that gives every stage one")
        self.offset = self.pp_rank * per_stage  # the global index of this stage's first layer
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        mcfg = spec.transformer_config(cfg, self.tp_size)
        if self.pp_size > 1:  # Megatron's schedule: P2P as gloo has it, the loss as the schedule returns it
            mcfg = dataclasses.replace(mcfg, pipeline_model_parallel_size=self.pp_size, pipeline_dtype=cfg.torch_dtype,
                                       batch_p2p_comm=False, calculate_per_token_loss=True)
        block = spec.block_spec(cfg, self.fast)
        block = dataclasses.replace(block, submodules=dataclasses.replace(
            block.submodules, layer_specs=block.submodules.layer_specs[self.offset: self.offset + per_stage]))
        # Tied weights across stages: the last stage's own copy (Megatron's shared-embedding setup moves it to CUDA).
        tied = cfg.tie_word_embeddings
        self.tied_copy = tied and self.last_stage and not self.first_stage
        self.gpt = GPTModel(mcfg, block, vocab_size=self.padded_vocab, max_sequence_length=cfg.max_position_embeddings,
                            position_embedding_type="none", share_embeddings_and_output_weights=tied and self.pp_size == 1,
                            parallel_output=True, pre_process=self.first_stage, post_process=self.last_stage)
        if not self.fast:
            if self.tp_size > 1:
                h, d, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
                layers.check_split_outputs({(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d), (h, 2 * inner),
                                            (cfg.num_heads * d, h), (inner, h), (h, self.padded_vocab)},
                                           self.tp_size, cfg.torch_dtype)
            if self.last_stage:
                self.gpt.output_layer = layers.ColumnLinear(
                    cfg.hidden_size, self.padded_vocab, config=mcfg, tp_group=self.tp,
                    skip_weight_param_allocation=tied and self.first_stage)
        if self.pp_size > 1 and True in moe_stages:  # the routing record over stages (moe.StageRouting)
            stage = {int(_LAYER.match(n + ".").group(1)) + self.offset: m for n, m in self.gpt.named_modules()
                     if isinstance(m, moe.MoE) and _LAYER.match(n + ".")}
            routing = moe.StageRouting(stage, self.pp_group)
            for m in stage.values():
                m.stages = routing
        self.context = context.for_policy(self)  # megatron.cp > 1: packed rows over the context-parallel ranks
        self.to(self.device)

    # -- forward ----------------------------------------------------------------------------------
    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [B, T, padded_vocab / tp] (a stage before the last: its
        hidden states [T, B, hidden], from the input Megatron's schedule set)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        lo, hi = torch.aminmax(input_ids)
        if int(lo) < 0 or int(hi) >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}) in the model input: "
                             "check the tokenizer matches the model's vocab_size")
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(b, length)
        # Consistent attention is causal by construction; Megatron's own needs the mask (its default is on CUDA).
        mask = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)[None, None] if self.fast else None
        return self.gpt(input_ids, positions, mask, packed_seq_params=self._tokens(b, length, str(input_ids.device)))

    @functools.lru_cache(maxsize=16)
    def _tokens(self, b: int, length: int, device: str) -> layers.TokenParams:
        """The layers' view of a dense [b, length] batch (reused by every layer and every step of that shape)."""
        cfg = self.config
        t = Tokens(torch.zeros(0, dtype=torch.long, device=device), torch.arange(length, device=device).repeat(b),
                   torch.arange(b, device=device).repeat_interleave(length), None, (b, length))
        return layers.TokenParams(tokens=prepared(cfg, t, cfg.num_heads // self.tp_size, cfg.num_kv_heads // self.tp_size))

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) at `temperature`; 0 past each length
        and, with `mask` ([B, T-1]), where it is 0 (the built-in Decoder's contract; computed at every position).
        One stage holds the whole model only at pp = 1 (under pp, data_parallel.DataParallel runs the schedule).
        The inputs are moved to the policy's device; the logprobs come back on input_ids' device."""
        home = input_ids.device
        input_ids, lengths, mask = (None if t is None else t.to(self.device) for t in (input_ids, lengths, mask))
        return self._token_logprobs(input_ids, lengths, temperature, mask).to(home)

    def _token_logprobs(self, input_ids, lengths, temperature, mask) -> torch.Tensor:
        if self.context is not None:  # the token layout of context parallelism (context.py)
            return zero_outside(self.context.token_logprobs(input_ids, lengths, temperature), mask)
        if self.pp_size > 1:
            raise ValueError(f"megatron.pp = {self.pp_size}: one stage has no whole forward; call the logprobs through "
                             "data_parallel.DataParallel, which runs Megatron's pipeline schedule")
        return zero_outside(self.logprobs_of(self._logits(input_ids), input_ids, lengths, temperature), mask)

    def logprobs_of(self, logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor | None,
                    temperature: float) -> torch.Tensor:
        """token_logprobs from the last stage's logits of `input_ids` (no mask)."""
        b, length = input_ids.shape
        logits = logits[:, :-1]
        targets = input_ids[:, 1:]
        vocab = self.config.vocab_size
        if self.fast:
            x = logits.float() / temperature
            if self.padded_vocab != vocab:  # padding columns take no probability
                col = torch.arange(x.shape[-1], device=x.device) + self.tp_rank * x.shape[-1]
                x = x.masked_fill(col >= vocab, float("-inf"))
            lp = -vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(), targets.t().contiguous()).t()
        else:
            # The vocabulary-parallel log-softmax gathers the logits: its sum over the vocabulary is then exactly
            # ops.log_softmax's (fixed blocks of the whole vocabulary), whatever the TP size.
            full = gather_last(logits, self.tp)[..., :vocab]
            lp = ops.token_logprobs(full.reshape(b * (length - 1), vocab), targets.reshape(-1), temperature).view(b, length - 1)
        if lengths is not None:
            valid = torch.arange(length - 1, device=input_ids.device)[None, :] < (lengths.to(input_ids.device)[:, None] - 1)
            lp = torch.where(valid, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        return lp

    # -- weights in Hugging Face names --------------------------------------------------------------
    def _vocab_rows(self, name: str) -> bool:
        return name in ("embedding.word_embeddings.weight", "output_layer.weight")

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model (this stage's layer j is layer offset + j)."""
        if not self.offset:
            return name
        return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + self.offset}.", name)

    def stage_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(whole-model name, parameter) of this stage's own parameters: the tied copy of the embedding on a
        last stage is the embedding's, not one of its own."""
        return [(self.global_name(n), p) for n, p in self.gpt.named_parameters()
                if not (self.tied_copy and n == "output_layer.weight")]

    def whole(self, of=lambda p: p.detach()) -> dict[str, torch.Tensor]:
        """`of(parameter)` for every parameter of the whole model, whole tensors in Hugging Face names (a
        collective over the tensor- and pipeline-parallel groups: every rank gets them all). state_dict is
        whole(); whole(lambda p: p.grad) the gradients."""
        mine = {}
        for name, p in self.stage_parameters():
            t = of(p)
            if t is None:
                continue
            parts = list(gather_parts(t, self.tp).unbind(0)) if self.tp_size > 1 else [t]
            t = convert.unshard(name, parts, p)
            mine[name] = t[: self.config.vocab_size] if self._vocab_rows(name) else t
        if self.pp_size > 1:
            stages = [None] * self.pp_size
            dist.all_gather_object(stages, mine, group=self.pp_group)
            mine = {k: v for stage in stages for k, v in stage.items()}
        return {k: v.to("cpu", copy=True) for k, v in convert.to_hf(mine, self.config).items()}

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Whole weights in Hugging Face names, on the CPU (a collective over the tensor- and pipeline-parallel
        groups)."""
        return self.whole()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load whole Hugging Face-named weights (this rank keeps its part)."""
        try:
            whole = convert.to_megatron(state_dict, self.config)
        except KeyError as e:
            raise ValueError(f"weights for the Megatron learner lack {e.args[0]}: not a checkpoint of this model") from None
        if self.tied_copy:  # the last stage's copy of the tied embedding
            whole["output_layer.weight"] = whole["embedding.word_embeddings.weight"]
        params = {self.global_name(n): p for n, p in self.gpt.named_parameters()}
        missing = sorted(set(params) - set(whole))
        if missing:
            raise ValueError(f"weights for the Megatron learner lack {missing[0]} (and {len(missing) - 1} more)")
        for name, p in params.items():
            t = whole[name]
            if self._vocab_rows(name) and self.padded_vocab != t.shape[0]:
                t = F.pad(t, (0, 0, 0, self.padded_vocab - t.shape[0]))
            part = convert.shard(name, t, p, self.tp_rank, self.tp_size)
            if part.shape != p.shape:
                raise ValueError(f"weight {name}: shape {tuple(part.shape)} does not fit the model's {tuple(p.shape)}")
            p.copy_(part)
        return nn.modules.module._IncompatibleKeys([], [])

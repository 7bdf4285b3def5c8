"""`NemoRZForCausalLM`: the model class vLLM builds for architecture "NemoRZForCausalLM".

It holds a `nemo_rz.models.Decoder` (HF parameter names, built from the checkpoint's config.json with
`nemo_rz.models.hf.config_from_hf`, the learner's own loading path) plus one parameter-free vLLM `Attention`
per layer, used only to make vLLM allocate a paged KV cache and build metadata with our builder. Everything
that reaches a logprob is a `nemo_rz.ops` call made by the Decoder, the same calls the learner makes:

- forward: `Decoder.hidden(Tokens(ids, positions, seq_idx, cache=PagedKVCache(...)))`;
- compute_logits: `ops.log_softmax(decoder.logits(h), T)`, float32 log-probabilities at the engine's
  temperature T. With `logprobs_mode="raw_logits"` vLLM records these values verbatim and samples from them
  at temperature 1 (softmax of log-probabilities is the same distribution), so the recorded logprob is
  log_softmax(logits / T) computed by nemo_rz.ops, as the learner's `Decoder.token_logprobs` computes it.

Engine-wide settings arrive through `hf_overrides` (they end up on the HF config): `nemo_rz_temperature`
(float), `nemo_rz_kernels` ("consistent" | "fast") and `nemo_rz_precision` (the `precision.*` mapping of
nemo_rz.quant: the Decoder's linears quantized as the learner's are). The class is not decorated for
torch.compile, so vLLM always runs it eagerly.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from nemo_rz import ops
from nemo_rz.generation.vllm.attention import NemoRZAttentionBackend, PagedKVCache, PagedLayers
from nemo_rz.models import families
from nemo_rz.models.config import DTYPES
from nemo_rz.models.decoder import Decoder, Tokens
from nemo_rz.models.hf import CONFIG_FILE, config_from_hf
from nemo_rz.models.lora import apply_lora, is_adapter
from nemo_rz.models.mla import latent_dim
from nemo_rz.quant.apply import apply_precision


def decoder_config(vllm_config: VllmConfig):
    """The DecoderConfig the learner's `load_hf` would build for this checkpoint, in vLLM's model dtype."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    file = os.path.join(str(mc.model), CONFIG_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            d, source = json.load(f), file
    else:  # not a local directory: the config vLLM resolved, with the architecture it had before our override
        d, source = hf.to_dict(), f"the HF config of {mc.model}"
        d["architectures"] = [getattr(hf, "nemo_rz_architecture", None) or "Qwen3ForCausalLM"]
    names = {v: k for k, v in DTYPES.items()}
    if mc.dtype not in names:
        raise ValueError(f"nemo_rz vLLM backend: dtype {mc.dtype} is not supported; use float32 or bfloat16")
    return config_from_hf(d, source, names[mc.dtype])


@contextlib.contextmanager
def _ops_context(kernels: str):
    """Run nemo_rz.ops outside vLLM's inference mode (under no_grad): ops keep module-level caches (masks,
    layouts, RoPE tables), and a cache entry created as an inference tensor would break a learner's backward
    later in the same process (in-process engines)."""
    with torch.inference_mode(False), torch.no_grad(), ops.use_kernels(kernels):
        yield


class NemoRZForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.config = cfg = decoder_config(vllm_config)
        self.temperature = float(getattr(hf, "nemo_rz_temperature", 1.0))
        self.kernels = getattr(hf, "nemo_rz_kernels", None) or ops.get_kernels()
        if self.kernels not in ops.KERNELS:
            raise ValueError(f"nemo_rz vLLM backend: nemo_rz_kernels={self.kernels!r}: use one of {', '.join(ops.KERNELS)}")
        self.decoder = apply_lora(apply_precision(Decoder(cfg), getattr(hf, "nemo_rz_precision", None)),
                                  getattr(hf, "nemo_rz_lora", None)).requires_grad_(False)
        # Parameter-free: they register cache-scale buffers only, so named_parameters() is the Decoder's.
        # A latent-attention model (models/mla.py) caches one row of kv_lora_rank + qk_rope_head_dim per token
        # and layer, read as keys and values alike: one cache "head" of that width and no value half
        # (head_size_v=0), so vLLM allocates block_size * latent_dim values per block and layer, not twice that.
        self.latent = cfg.attention_kind == "mla"
        head, head_v = (latent_dim(cfg), 0) if self.latent else (cfg.head_dim, None)
        self.layer_names = [f"{prefix}model.layers.{i}.self_attn.attn" for i in range(cfg.num_layers)]
        self.kv_layers = nn.ModuleList(
            Attention(cfg.num_heads, head, cfg.attention_scale, num_kv_heads=cfg.num_kv_heads, head_size_v=head_v,
                      cache_config=vllm_config.cache_config, prefix=name, attn_backend=NemoRZAttentionBackend)
            for name in self.layer_names
        )
        self._paged: PagedLayers | None = None  # views of the cache tensors (_caches)

    # -- vLLM model contract (vllm/model_executor/models/interfaces_base.py) ------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        with _ops_context(self.kernels):
            return ops.embedding(input_ids, self.decoder.model.embed_tokens.weight)

    def _metadata(self):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        if isinstance(md, list):  # micro-batched form (not used on CPU)
            md = md[0] if md else None
        return md.get(self.layer_names[0]) if isinstance(md, dict) else None

    def _caches(self) -> PagedLayers:
        """Views of the layers' cache tensors, made again only when vLLM hands over other tensors."""
        out = []
        for layer in self.kv_layers:
            kv = layer.kv_cache
            out.append(kv[0] if isinstance(kv, (list, tuple)) else kv)
        if self._paged is None or self._paged.key != PagedLayers.key_of(out):
            self._paged = PagedLayers(out, latent=self.latent)
        return self._paged

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("nemo_rz vLLM backend: prompt embeddings are not supported; send token ids")
        total = positions.shape[0]
        md = self._metadata()
        if md is None or md.num_tokens == 0:  # vLLM's dummy / profiling runs: no cache, output unused
            return torch.zeros(total, self.config.hidden_size, dtype=self.config.torch_dtype, device=positions.device)
        n = md.num_tokens
        with _ops_context(self.kernels):
            ids = input_ids[:n].to(torch.int64)
            pos, seq_idx = md.positions.clone(), md.seq_idx.clone()  # normal tensors, not inference ones
            if not torch.equal(positions[:n].to(torch.int64), pos):
                raise RuntimeError("nemo_rz vLLM backend: positions from vLLM disagree with the attention metadata")
            cache = PagedKVCache(self._caches(), md)
            hidden = self.decoder.hidden(Tokens(ids, pos, seq_idx, cache=cache))
        if n < total:  # padded tokens (never seen on CPU): zeros, never sampled from
            hidden = torch.cat([hidden, hidden.new_zeros(total - n, hidden.shape[1])])
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 log_softmax(logits / T): vLLM (logprobs_mode="raw_logits") records and samples from these."""
        with _ops_context(self.kernels):
            return ops.log_softmax(self.decoder.logits(hidden_states), self.temperature)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors -> the Decoder's parameters, through each parameter's `weight_loader` (vLLM's
        in-place reload swaps parameters for ones whose loader does the copy; a bare copy_ would load nothing).
        Returns the names loaded, as vLLM checks them against named_parameters()."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        params.update(self.decoder_buffers())  # state-dict buffers (DeepSeek's float32 e_score_correction_bias)
        loaded, per_expert = set(), {}
        family = families.for_config(self.config)  # the family's file layout (families.base.Family)
        for name, tensor in weights:
            if family.ignored(name, self.config):
                continue
            if family.per_expert is not None and family.per_expert.search(name):  # one tensor per expert: stacked below
                per_expert[name] = tensor
                continue
            self._load_one(params, name, tensor, default_weight_loader)
            loaded.add("decoder." + name)
        if per_expert:
            shapes = {name[len("decoder."):]: tuple(p.shape) for name, p in params.items()}
            for name, tensor in family.stack(per_expert, shapes).items():
                self._load_one(params, name, tensor, default_weight_loader)
                loaded.add("decoder." + name)
        # The loaders write through .data, which no version counter sees: drop every copy derived from the old
        # weights (GEMM operands, expert layouts, float32 and quantized copies; ops.weight_cache).
        ops.forget_weight_copies(self)
        if loaded and not any(is_adapter(n) for n in loaded):  # the start checkpoint holds the base: the LoRA
            loaded |= {n for n, _ in self.named_parameters() if is_adapter(n)}  # adapters follow as an update
        return loaded

    def decoder_buffers(self) -> dict[str, torch.Tensor]:
        """The Decoder's buffers that its state dict holds (they travel with the weights), by full name."""
        state = set(self.decoder.state_dict())
        return {"decoder." + n: b for n, b in self.decoder.named_buffers() if n in state}

    @staticmethod
    def _load_one(params: dict, name: str, tensor: torch.Tensor, default_loader) -> None:
        param = params.get("decoder." + name)
        if param is None:
            raise ValueError(f"nemo_rz vLLM backend: checkpoint tensor {name!r} is not a parameter of the nemo_rz Decoder")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"nemo_rz vLLM backend: {name} has shape {list(tensor.shape)}, the model expects {list(param.shape)}")
        if not isinstance(param, nn.Parameter):  # a buffer keeps its own dtype (float32 in a bfloat16 model)
            param.data.copy_(tensor)
            return
        getattr(param, "weight_loader", default_loader)(param, tensor)

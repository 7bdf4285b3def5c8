"""vLLM's paged KV cache and per-step metadata, read and written by nemo-rz's own attention.

vLLM's `Attention` layers are kept in the model only so that vLLM allocates a paged KV cache for them and
builds attention metadata with our builder. The arithmetic never goes through vLLM: the model's forward
wraps each layer's cache tensor in `PagedKVCache` (the `Tokens.cache` protocol of `nemo_rz.models.decoder`)
and `nemo_rz.ops.attention` reads it through the block table.

The CPU platform always picks its own backend (vllm/platforms/cpu.py), so the model passes
`NemoRZAttentionBackend` to each `Attention` explicitly. It subclasses vLLM's CPU backend to keep that
backend's cache layout and block-size rules; its `get_name()` is the existing enum member "CUSTOM" because
vLLM resolves the name through `AttentionBackendEnum`.

Cache tensor of one layer (vLLM CPU layout): `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`, one
contiguous page of `block_size * 2 * head_dim` values per (block, kv head). We split each page as
`[2, block_size, head_dim]`: keys first, values second (the same split vLLM's CPU kernels use, so a cache is
never misread by either side). Token slot s lives at (block s // block_size, offset s % block_size).

A latent-attention layer (models/mla.py) has no value half: its Attention is declared with head_size_v=0, so
its cache tensor is `[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]`, one latent row per token
and layer, which `nemo_rz.ops.attention` reads as keys and values alike (the same tensor, as the built-in
engine's KVCache and the learner's BatchKV hand it over).
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from nemo_rz import ops


@dataclasses.dataclass
class NemoRZAttentionMetadata:
    """One engine step, shared by every layer: which request (row of `block_table`) each scheduled token belongs
    to, where its key/value go, and each request's blocks."""

    num_tokens: int  # scheduled tokens (no padding on CPU)
    num_reqs: int
    seq_idx: torch.Tensor  # [num_tokens] int64: the token's request = its row in block_table
    positions: torch.Tensor  # [num_tokens] int64: the token's position in its sequence
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64 physical block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each token (block * block_size + offset)
    block_size: int


class NemoRZAttentionMetadataBuilder(AttentionMetadataBuilder[NemoRZAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.device = device
        self.block_size = int(kv_cache_spec.block_size)
        if self.block_size % ops.KV_BLOCK:
            raise ValueError(
                f"vLLM block_size {self.block_size} is not a multiple of {ops.KV_BLOCK} (nemo_rz.ops.KV_BLOCK); "
                "pass block_size=32, 64 or 128"
            )

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        m = common_attn_metadata
        reqs = int(m.num_reqs)
        starts = m.query_start_loc_cpu[: reqs + 1].to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        n = int(starts[-1])
        seq_idx = torch.repeat_interleave(torch.arange(reqs), q_lens)
        # token t of request r sits at position (context before this step) + (t - first token of r)
        context = m.seq_lens[:reqs].to(device="cpu", dtype=torch.int64) - q_lens
        positions = context[seq_idx] + torch.arange(n) - starts[:-1][seq_idx]
        return NemoRZAttentionMetadata(
            num_tokens=n,
            num_reqs=reqs,
            seq_idx=seq_idx.to(self.device),
            positions=positions.to(self.device),
            block_table=m.block_table_tensor[:reqs].to(torch.int64),
            slot_mapping=m.slot_mapping[:n].to(torch.int64),
            block_size=self.block_size,
        )


class NemoRZAttentionImpl(AttentionImpl[NemoRZAttentionMetadata]):
    """Holds the layer's settings; never computes. The model calls `nemo_rz.ops.attention` through the Decoder
    instead of `Attention.forward`, so vLLM's attention kernels cannot end up in the numbers."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **extra):
        if alibi_slopes is not None or logits_soft_cap:
            raise ValueError("nemo_rz vLLM backend: ALiBi and logit soft-capping are not supported")
        if sliding_window is not None:
            raise ValueError("nemo_rz vLLM backend: sliding-window attention is not supported; use a full-attention model")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"nemo_rz vLLM backend: attention type {attn_type} is not supported (decoder only)")
        if kv_cache_dtype not in ("auto", None):
            raise ValueError(
                f"nemo_rz vLLM backend: kv_cache_dtype={kv_cache_dtype!r} would quantize keys/values and break "
                "consistency with the learner; leave kv_cache_dtype at 'auto'"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        raise RuntimeError(
            "nemo_rz vLLM backend: Attention.forward was called; NemoRZForCausalLM computes attention with "
            "nemo_rz.ops through its Decoder and never routes through vLLM's attention layers"
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        raise RuntimeError("nemo_rz vLLM backend: the Decoder writes the KV cache itself (PagedKVCache.write)")


class NemoRZAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend (cache layout, block sizes multiple of 32) with our metadata and no kernels."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return NemoRZAttentionImpl

    @staticmethod
    def get_builder_cls():
        return NemoRZAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # our attention works for any (even) head size; vLLM's CPU kernels, which need 32..512, never run

    @classmethod
    def supports_sink(cls) -> bool:
        return False


class PagedLayers:
    """Views of vLLM's per-layer cache tensors, made once per set of cache tensors (they live as long as the
    engine): `flat[layer]` [num_blocks * Hkv * 2 * block_size, D] rows for the writes, `k[layer]` / `v[layer]`
    strided [num_blocks, Hkv, block_size, D] views for `nemo_rz.ops.attention`. latent: the layers' caches hold
    one latent row per token ([num_blocks, 1, block_size, D], no value half): `v[layer] is k[layer]`."""

    def __init__(self, layers: list[torch.Tensor], latent: bool = False):
        self.key = self.key_of(layers)
        self.latent = latent
        self.flat, self.k, self.v = [], [], []
        for kv in layers:
            if kv.dim() != 4 or not kv.is_contiguous() or (latent and kv.shape[1] != 1):
                raise RuntimeError(
                    f"nemo_rz vLLM backend: unexpected KV cache tensor {tuple(kv.shape)} (contiguous={kv.is_contiguous()}); "
                    "expected vLLM's CPU layout [num_blocks, num_kv_heads, block_size, 2 * head_dim]"
                    + (" with one latent row per token: [num_blocks, 1, block_size, latent_dim]" if latent else "")
                )
            blocks, kv_heads, block_size, width = kv.shape
            if latent:
                self.flat.append(kv.view(-1, width))
                self.k.append(kv)
                self.v.append(kv)
                continue
            pages = kv.view(blocks, kv_heads, 2, block_size, width // 2)
            self.flat.append(kv.view(-1, width // 2))
            self.k.append(pages[:, :, 0])
            self.v.append(pages[:, :, 1])
        _, self.kv_heads, self.block_size, _ = layers[0].shape

    @staticmethod
    def key_of(layers: list[torch.Tensor]) -> tuple:
        """Identity of a set of cache tensors: storage, shape and dtype of each (a re-allocated cache gets new views)."""
        return tuple((kv.data_ptr(), tuple(kv.shape), kv.dtype) for kv in layers)


class PagedKVCache:
    """`Tokens.cache` over vLLM's per-layer cache tensors (a `PagedLayers`) for one engine step.

    write(layer, k, v, t): store the step's keys/values [N, Hkv, D] at their slots;
    view(layer): (keys, values, block_table) for `nemo_rz.ops.attention`, keys/values as strided views
    [num_blocks, Hkv, block_size, D] of the layer's cache tensor.
    """

    def __init__(self, layers: PagedLayers, md: NemoRZAttentionMetadata):
        if layers.block_size != md.block_size:
            raise RuntimeError(f"nemo_rz vLLM backend: cache block size {layers.block_size} != scheduler block size {md.block_size}")
        self.layers = layers
        self.block_table = md.block_table.clone()  # built under inference mode; a normal tensor from here on
        kv_heads, block_size = layers.kv_heads, layers.block_size
        slots = md.slot_mapping.clone()
        if bool((slots < 0).any()):
            raise RuntimeError("nemo_rz vLLM backend: a scheduled token has no cache slot (slot -1)")
        # Row of each (token, kv head) key in the cache viewed as [num_blocks * Hkv * 2 * block_size, D]; the value
        # row is block_size further on. A latent cache has one row per token: [num_blocks * block_size, D].
        heads = torch.arange(kv_heads, device=slots.device)
        page = (slots // block_size)[:, None] * kv_heads + heads  # [N, Hkv]
        halves = 1 if layers.latent else 2
        self._k_rows = (page * (halves * block_size) + (slots % block_size)[:, None]).reshape(-1)
        self._v_rows = None if layers.latent else self._k_rows + block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, t=None) -> None:
        flat = self.layers.flat[layer]
        d = flat.shape[-1]
        if self._v_rows is None and v is not k:
            raise RuntimeError("nemo_rz vLLM backend: a latent cache holds one row per token; the layer passed separate values")
        flat.index_copy_(0, self._k_rows, k.reshape(-1, d).to(flat.dtype))
        if self._v_rows is not None:
            flat.index_copy_(0, self._v_rows, v.reshape(-1, d).to(flat.dtype))

    def view(self, layer: int):
        return self.layers.k[layer], self.layers.v[layer], self.block_table

"""DeepSeek-V3's multi-token prediction (MTP) layers as the speculative-decoding draft (`draft.kind=mtp`).

A DeepSeek-V3 checkpoint carries num_nextn_predict_layers MTP layers after its decoder, as
`model.layers.{num_hidden_layers + j}.*`: `enorm`, `hnorm`, `eh_proj`, a full decoder layer of the model's own kind
(`self_attn` latent attention, `mlp` a mixture of experts where the model's last layer is one, the two layer
norms), `shared_head.norm` and `shared_head.head`, and a copy of the shared `embed_tokens`. At position i, with
the target's final (normed) hidden state h_i and the next token t_{i+1}:

    x   = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      (embed(...) is 0 at position 0)
    g_i = shared_head.norm(layer(x))                             the MTP's hidden state
    logits(t_{i+2}) = shared_head.head(g_i)

(vLLM's and SGLang's reading of the release; transformers' DeepseekV3 ignores these tensors.) Further draft
tokens feed g_i back in place of h_i, through the same layer (layer 0: DeepSeek-V3 ships one; further layers are
loaded and saved back but do not draft), exactly as the EAGLE-3 head feeds its own states back, so `MTPHead` is a
`DraftHead` whose hooks are DeepSeek's: the target features are the final hidden states (the fusion `fc` is the
identity), the input is eh_proj of the two normed halves, the output is shared_head.norm, the head is its own
`shared_head.head` over the whole vocabulary. Everything else (the engine's draft-and-verify policy, the
training-time-test loss distilled from the target's distribution, the learner's auxiliary-loss hook) is the
draft's own code. The embedding and `shared_head.head` are the target's shared tensors: they get no gradient from
the draft loss (the target stays frozen for it, as for the EAGLE-3 head).

`load_mtp(path, target)` reads the layers from a checkpoint directory (one line when it has none);
`save_hf_with_mtp(model, head, path)` writes the model and its MTP layers back in the hub's layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Decoder, KVCache
from nemo_rz.models.draft import DraftHead
from nemo_rz.models.layers import Block, Linear, norm

NO_LAYERS = "use draft.kind=eagle (a draft trained online), or a checkpoint that ships MTP layers"


def mtp_config(target: DecoderConfig) -> DecoderConfig:
    """One decoder layer of the target's kind, as layer num_layers would be: latent or GQA attention (full, no
    window), a mixture of experts where the target's last layer has one (DeepSeek's are a suffix)."""
    last = target.num_layers - 1
    return dataclasses.replace(target, num_layers=1, layer_types=None, sliding_window=None,
                               moe_layers=[0] if target.is_moe(last) else [])


class SharedHead(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.norm = norm(cfg)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.torch_dtype)
        self.head.weight.requires_grad_(False)  # the target's output head, shared: not trained by the draft loss


class MTPLayer(Block):
    """One MTP layer: the decoder layer (Block's `self_attn`, `mlp` and norms, under the names the hub uses) and
    DeepSeek's `enorm`, `hnorm`, `eh_proj`, `shared_head`."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg, 0)
        h, dt = cfg.hidden_size, cfg.torch_dtype
        self.enorm = norm(cfg)
        self.hnorm = norm(cfg)
        self.eh_proj = Linear(2 * h, h, False, dt)
        self.shared_head = SharedHead(cfg)


class MTPHead(DraftHead):
    kind = "mtp"

    def __init__(self, target: DecoderConfig, num_layers: int = 1):
        nn.Module.__init__(self)
        if num_layers < 1:
            raise ValueError(f"MTP layers: {num_layers}; need at least 1 (num_nextn_predict_layers)")
        self.aux_layers = ()
        self.config = mtp_config(target)
        self.fc = nn.Identity()  # the target features are its final hidden states, read as they are
        self.layers = nn.ModuleList(MTPLayer(self.config) for _ in range(num_layers))
        self.register_buffer("vocab", torch.arange(target.vocab_size), persistent=False)  # the whole vocabulary

    # -- DraftHead's hooks ---------------------------------------------------------------------------
    @property
    def blocks(self) -> list:
        return [self.layers[0]]

    def tap(self, model: Decoder, final: bool = False):
        return final_features(model, final)

    def _input(self, target, feature, tokens, positions):
        layer = self.layers[0]
        emb = ops.embedding(tokens, target.model.embed_tokens.weight.detach())
        emb = torch.where((positions == 0)[:, None], torch.zeros((), dtype=emb.dtype), emb)
        return layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(feature)], dim=-1))

    def _output(self, x):
        return self.layers[0].shared_head.norm(x)

    def logits(self, target, g):
        return ops.linear(g, self.layers[0].shared_head.head.weight)

    def target_logits(self, target, final):
        return ops.linear(final, target.head_weight.detach())

    def worker_spec(self) -> dict:
        return dict(kind=self.kind, num_layers=len(self.layers))

    def spec(self) -> dict:
        c = self.config
        return dict(kind=self.kind, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=len(self.layers))

    def check_target(self, target: Decoder) -> None:
        t, c = target.config, self.config
        if mtp_config(t) != c:
            raise ValueError(f"the MTP layers were made for another model (hidden_size {c.hidden_size}, vocab_size "
                             f"{c.vocab_size}) than this target ({t.hidden_size}, {t.vocab_size}); load them with its "
                             "checkpoint (nemo_rz.models.mtp.load_mtp)")

    def new_cache(self, num_seqs: int, max_len: int) -> KVCache:
        """The drafting layer's cache: the target's kind (one latent row per token for latent attention, held once)."""
        c = self.config
        max_len += (-max_len) % ops.KV_BLOCK
        latent = c.attention_kind == "mla"
        dim = c.kv_lora_rank + c.head_dim if latent else c.head_dim
        k = [torch.zeros(num_seqs, c.num_kv_heads, max_len, dim, dtype=c.torch_dtype)]
        return KVCache(k, list(k) if latent else [torch.zeros_like(k[0])])

    # -- the checkpoint's layout ---------------------------------------------------------------------
    def file_tensors(self, target: Decoder) -> dict[str, torch.Tensor]:
        """{hub name: tensor} of the MTP layers after `target`'s decoder: experts one tensor per expert, the
        shared embedding copied into each layer, as DeepSeek-V3's release stores them."""
        from nemo_rz.models.hf import _unstack_experts

        base = target.config.num_layers
        own = {f"model.{name}": t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        out = {}
        for name, t in _unstack_experts(own, self.config, _ARCH).items():
            j, rest = _split(name)
            out[f"model.layers.{base + j}.{rest}"] = t
        emb = target.model.embed_tokens.weight.detach().to("cpu").contiguous()
        out.update({f"model.layers.{base + j}.embed_tokens.weight": emb.clone() for j in range(len(self.layers))})
        return out


_ARCH = "DeepseekV3ForCausalLM"


def _split(name: str) -> tuple[int, str]:
    """"model.layers.{j}.rest" -> (j, rest)."""
    _, _, j, rest = name.split(".", 3)
    return int(j), rest


@contextlib.contextmanager
def final_features(model: Decoder, final: bool = False):
    """Within the block, every forward of `model` appends its tokens' final hidden states [N, hidden] (the final
    norm's output, detached) to the yielded list; with `final`, as a pair (features, final hidden states), which
    here are one tensor (the shape aux_features(final=True) gives)."""
    found: list = []

    def keep(_module, _args, out):
        out = out.detach()
        found.append((out, out) if final else out)

    handle = model.model.norm.register_forward_hook(keep)
    try:
        yield found
    finally:
        handle.remove()


def mtp_layers(path: str | os.PathLike) -> int:
    """num_nextn_predict_layers of a checkpoint directory's config.json (0 when absent)."""
    from nemo_rz.models.hf import read_json
    from nemo_rz.models.hf_config import CONFIG_FILE, ModelFileError

    file = Path(path) / CONFIG_FILE
    d = read_json(file)
    n = d.get("num_nextn_predict_layers", 0) if isinstance(d, dict) else 0
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ModelFileError(f"num_nextn_predict_layers={n!r} in {file}: expected a count >= 0; fix config.json")
    return n


def load_mtp(path: str | os.PathLike, target: Decoder) -> MTPHead:
    """The MTP layers of the checkpoint directory `path` (the one `target` was loaded from), as a draft for
    `target`: names, shapes and finiteness checked as load_hf checks the decoder's, FP8 releases decoded exactly.
    One-line ModelFileError when the checkpoint has none."""
    from nemo_rz.models import hf
    from nemo_rz.models.hf_config import CONFIG_FILE, ModelFileError

    root = Path(path)
    n = mtp_layers(root)
    if n == 0:
        raise ModelFileError(f"draft.kind=mtp: {root / CONFIG_FILE} has no multi-token-prediction layers "
                             f"(num_nextn_predict_layers = 0 or absent); {NO_LAYERS}")
    cfg, base = target.config, target.config.num_layers
    with torch.device("meta"):
        head = MTPHead(cfg, n)
    params = {f"model.{k}": v for k, v in head.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    files = hf._weight_files(root)
    mine = {f"model.layers.{base + j}.": j for j in range(n)}

    def ours(name: str) -> str | None:  # the file name of an MTP tensor -> "model.layers.{j}.rest" (None: not one)
        prefix = ".".join(name.split(".")[:3]) + "."
        j = mine.get(prefix)
        if j is None or name.endswith(".embed_tokens.weight"):  # the embedding is the target's (shared)
            return None
        return f"model.layers.{j}.{name[len(prefix):]}"

    headers = {name: entry for name, entry in hf._headers(files).items() if ours(name) is not None}
    where = hf._where(files)
    raw = hf._read(files, headers, lambda n_, t: t)
    d = hf.read_json(root / CONFIG_FILE)
    if d.get("quantization_config"):
        from nemo_rz.quant.checkpoints import dequantized

        try:
            raw = dequantized(raw, d["quantization_config"])
        except ValueError as e:
            raise ModelFileError(f"{where}: {e}") from None
    tensors = {ours(name): t for name, t in raw.items()}
    fam = hf._family(cfg, _ARCH)
    per_expert = fam.per_expert is not None and any(fam.per_expert.search(k) for k in tensors)
    expected = fam.file_shapes(shapes, head.config) if per_expert else shapes
    found = {k: (tuple(t.shape), hf._SAFETENSORS_NAMES.get(t.dtype, str(t.dtype))) for k, t in tensors.items()}
    try:
        hf._check(found, expected, where, f"{_ARCH} MTP", head.config)
    except ModelFileError as e:
        raise ModelFileError(f"draft.kind=mtp: the MTP layers (model.layers.{base}..{base + n - 1}): {e}") from None
    out = {k: hf._owned(t, cfg, params.get(k)) for k, t in tensors.items()}
    bad = [k for k, t in out.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ModelFileError(f"draft.kind=mtp: non-finite values (NaN/Inf) in {hf._names(bad)} of the MTP layers in "
                             f"{where}; the checkpoint is corrupt, use another")
    if per_expert:
        out = fam.stack(out, shapes)
    head.load_state_dict({k[len("model."):]: v for k, v in out.items()}, strict=True, assign=True)
    head.vocab = torch.arange(cfg.vocab_size)  # (a buffer built on the meta device)
    for layer in head.layers:
        layer.shared_head.head.weight.requires_grad_(False)
    return head.eval()


def save_hf_with_mtp(model: Decoder, head: MTPHead, path: str | os.PathLike, architecture: str | None = None) -> Path:
    """save_hf of `model` with `head`'s layers after its decoder (num_nextn_predict_layers in config.json): the
    hub's layout, which load_hf (decoder) and load_mtp (these layers) read back bit for bit."""
    from nemo_rz.models.hf import save_hf

    head.check_target(model)
    return save_hf(model, path, architecture, extra_tensors=head.file_tensors(model),
                   extra_config={"num_nextn_predict_layers": len(head.layers)})

"""DeepSeek-V4 (DeepseekV4ForCausalLM, transformers 5.19's `models/deepseek_v4`): the layers are
models/deepseek_v4.py's (sliding / compressed sparse / heavily compressed attention, the lightning indexer,
hyper-connections, hash and top-k MoE with sqrt(softplus) scores).

config.json: the V4 keys (layer_types over sliding_attention / compressed_sparse_attention /
heavily_compressed_attention, compress_rates, mlp_layer_types, hc_*, o_groups, o_lora_rank, index_*) go to
DecoderConfig.deepseek_v4; transformers' legacy spellings (compress_ratios, num_hash_layers, qk_rope_head_dim)
are folded in as its config class does, and its defaults fill missing keys. The shared expert is one MLP of
moe_intermediate_size (transformers ignores n_shared_experts; nemo_rz refuses values other than 1).

Files: the layout transformers' save_pretrained writes (the release's names under `model.layers.{i}.`:
`attn.wq_a`, `attn.compressor.wkv`, `attn.indexer.compressor.ape`, `ffn.experts.{e}.w1`..., `head.weight`);
in memory transformers' module names (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj` stacked...). The
checkpoint's multi-token-prediction tensors (`mtp.*`) are skipped, as transformers does.
"""
import re

import torch

from nemo_rz.models.families.base import Family, ModelFileError, read_float, read_int

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
PER_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}

# {in-memory name within a layer: file name within a layer}
_IN_LAYER = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hc}_hc.{p}": f"hc_{hc}_{p}" for hc in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_TOP = {"model.embed_tokens.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "head.weight", "model.hc_head.hc_fn": "model.hc_head.hc_fn",
        "model.hc_head.hc_base": "model.hc_head.hc_base", "model.hc_head.hc_scale": "model.hc_head.hc_scale"}
_FROM_FILE = {v: k for k, v in _IN_LAYER.items()}
_TOP_FROM_FILE = {v: k for k, v in _TOP.items()}
_FLOAT32 = re.compile(r"(\.sinks|position_bias|_hc\.(fn|base|scale)|hc_head\.hc_\w+|e_score_correction_bias)$")


def file_name(name: str) -> str:
    """An in-memory (non-expert) parameter name -> its name in files."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _IN_LAYER:
        raise ValueError(f"DeepSeek-V4: no file name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_IN_LAYER[m.group(2)]}"


def model_name(name: str) -> str:
    """A (non-expert) file tensor's name -> the parameter it is."""
    if name in _TOP_FROM_FILE:
        return _TOP_FROM_FILE[name]
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _FROM_FILE:
        return name  # unknown: the load's name check reports it
    return f"model.layers.{m.group(1)}.{_FROM_FILE[m.group(2)]}"


def _types(d: dict, source: str, layers: int) -> tuple[list[str], list[str]]:
    """(layer_types, mlp_layer_types) as transformers' DeepseekV4Config derives them."""
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        ratios = d["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _RATIO_TYPES for r in ratios):
            raise ModelFileError(f"compress_ratios={ratios!r} in {source}: expected 0, 4 or 128 per layer; fix config.json")
        types = [_RATIO_TYPES[r] for r in ratios]
    if types is None:
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))]
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        n_hash = read_int(d, "num_hash_layers", source, 3, minimum=0)
        mlp = ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    for key, value, allowed in (("layer_types", types, LAYER_TYPES), ("mlp_layer_types", mlp, ("hash_moe", "moe"))):
        if not isinstance(value, list) or len(value) < layers or any(t not in allowed for t in value):
            raise ModelFileError(f"{key}={value!r} in {source}: expected one of {', '.join(allowed)} per layer "
                                 f"({layers}); fix config.json")
    return list(types[:layers]), list(mlp[:layers])


class DeepseekV4(Family):
    model_types = ("deepseek_v4",)
    partial_rotary = True  # hf_config's RoPE reader: the family reads partial_rotary_factor itself

    def natural(self, cfg) -> bool:
        return cfg.attention_kind == "deepseek_v4"

    def normalized(self, d: dict, source: str) -> dict:
        """config.json as the generic reader takes it: the shared expert's width as intermediate_size, the main
        RoPE's theta as rope_theta (the {main, compress} rope_parameters and V4's layer_types are read by
        family_keys only)."""
        from nemo_rz.models.hf_config import read_bool

        if d.get("quantization_config"):
            raise ModelFileError(f"{source} describes a quantized DeepSeek-V4 checkpoint: nemo_rz reads V4's float "
                                 "(bf16 / float32) weights only for now (FP8 / MXFP4 V4 tensors are not decoded); use them")
        if read_bool(d, "attention_bias", source, False) or read_bool(d, "mlp_bias", source, False):
            raise ModelFileError(f"attention_bias / mlp_bias in {source} are not supported: DeepSeek-V4 has no biases")
        rp = d.get("rope_parameters") or {}
        if not isinstance(rp, dict):
            raise ModelFileError(f"rope_parameters in {source} is {rp!r}: expected an object; fix config.json")
        main = rp.get("main") if isinstance(rp.get("main"), dict) else {"rope_type": "default"}
        if main.get("rope_type", "default") != "default":
            raise ModelFileError(f"rope_parameters.main in {source} is {main!r}: DeepSeek-V4's sliding layers use plain "
                                 "RoPE; fix config.json")
        out = {k: v for k, v in d.items() if k != "rope_scaling"}
        out.update(intermediate_size=read_int(d, "moe_intermediate_size", source, 2048),
                   num_key_value_heads=1, head_dim=d.get("head_dim", 512),  # one shared head, whatever this says

                   rope_theta=main.get("rope_theta", d.get("rope_theta", 10000.0)))  # the generic reader's theta
        return out

    def family_keys(self, d, source):
        from nemo_rz.models.hf_config import _one_rope

        super().family_keys(d, source)  # SwiGLU only
        if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ModelFileError(f"scoring_func={d['scoring_func']!r} in {source} is not supported: nemo_rz implements "
                                 "DeepSeek-V4's 'sqrtsoftplus'; use a DeepSeek-V4 checkpoint")
        if d.get("n_shared_experts", 1) != 1:
            raise ModelFileError(f"n_shared_experts={d['n_shared_experts']!r} in {source}: DeepSeek-V4 has one shared "
                                 "expert (transformers builds one whatever this says); set it to 1")
        layers = read_int(d, "num_hidden_layers", source, required=True)
        head_dim = read_int(d, "head_dim", source, 512)
        types, mlp = _types(d, source, layers)
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
        for key, legacy in (("compressed_sparse_attention", "compress_rate_csa"), ("heavily_compressed_attention", "compress_rate_hca")):
            if d.get(legacy) is not None:
                rates[key] = d[legacy]
        partial = d.get("partial_rotary_factor")
        if partial is None:
            rope_dim = d.get("qk_rope_head_dim")
            partial = rope_dim / head_dim if rope_dim is not None else 64 / 512
        rp = d.get("rope_parameters") or {}
        compress = dict(rp.get("compress") or {}) if isinstance(rp.get("compress"), dict) else {
            k: v for k, v in rp.items() if k not in ("main", "compress")}
        compress.setdefault("rope_theta", d.get("compress_rope_theta", 160000.0))
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)  # transformers: no YaRN mscale on the compressed RoPE
        theta, scaling = _one_rope(compress, d, source, "rope_parameters.compress", 160000.0, partial=True)
        v4 = dict(layer_types=types, mlp_layer_types=mlp,
                  csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
                  compress_theta=theta, compress_scaling=scaling,
                  hc_mult=read_int(d, "hc_mult", source, 4), hc_sinkhorn_iters=read_int(d, "hc_sinkhorn_iters", source, 20),
                  hc_eps=read_float(d, "hc_eps", source, 1e-6), o_groups=read_int(d, "o_groups", source, 8),
                  o_lora_rank=read_int(d, "o_lora_rank", source, 1024),
                  index_n_heads=read_int(d, "index_n_heads", source, 64),
                  index_head_dim=read_int(d, "index_head_dim", source, 128),
                  index_topk=read_int(d, "index_topk", source, 512))
        return dict(attention_kind="deepseek_v4", qk_norm=False, num_kv_heads=1, head_dim=head_dim,
                    q_lora_rank=read_int(d, "q_lora_rank", source, 1024), partial_rotary_factor=float(partial),
                    sliding_window=read_int(d, "sliding_window", source, 128),
                    swiglu_limit=read_float(d, "swiglu_limit", source, 10.0), deepseek_v4=v4)

    def moe(self, d, source, layers):
        out = dict(num_experts=read_int(d, "n_routed_experts", source, 256), moe_kind="deepseek",
                   num_experts_per_tok=read_int(d, "num_experts_per_tok", source, 6),
                   moe_intermediate_size=read_int(d, "moe_intermediate_size", source, 2048),
                   routed_scaling_factor=read_float(d, "routed_scaling_factor", source, 1.5))
        return out, list(range(layers))

    def write(self, cfg, out, types, sliding) -> None:
        from nemo_rz.models.deepseek_v4 import params

        v = params(cfg)
        scaling = dict(v.compress_scaling.__dict__) if v.compress_scaling is not None else None
        compress = {"rope_type": "default"} if scaling is None else scaling
        compress = {**compress, "rope_theta": v.compress_theta}
        compress["partial_rotary_factor"] = cfg.partial_rotary_factor
        for key in ("intermediate_size", "rope_scaling", "layer_types", "attention_bias"):
            out.pop(key, None)
        out.update(moe_intermediate_size=cfg.moe_intermediate_size, q_lora_rank=cfg.q_lora_rank,
                   num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.num_experts, n_shared_experts=1,
                   scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor,
                   layer_types=list(v.layer_types), mlp_layer_types=list(v.mlp_layer_types),
                   compress_rates={"compressed_sparse_attention": v.csa_rate, "heavily_compressed_attention": v.hca_rate},
                   compress_rope_theta=v.compress_theta, hc_mult=v.hc_mult, hc_sinkhorn_iters=v.hc_sinkhorn_iters,
                   hc_eps=v.hc_eps, swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window,
                   o_groups=v.o_groups, o_lora_rank=v.o_lora_rank, index_n_heads=v.index_n_heads,
                   index_head_dim=v.index_head_dim, index_topk=v.index_topk, num_nextn_predict_layers=0,
                   partial_rotary_factor=cfg.partial_rotary_factor, attention_bias=False, mlp_bias=False,
                   rope_parameters={"main": {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
                                             "partial_rotary_factor": cfg.partial_rotary_factor},
                                    "compress": compress})

    def ignored(self, name, cfg) -> bool:
        m = _LAYER.match(name)
        return super().ignored(name, cfg) or name.startswith(("mtp.", "model.mtp.")) or (
            m is not None and int(m.group(1)) >= cfg.num_layers)

    # files: the names above, one tensor per expert (w1 gate, w3 up, w2 down)
    def file_shapes(self, shapes, cfg):
        out = {}
        for name, shape in shapes.items():
            m = _LAYER.match(name)
            if m is not None and m.group(2) == "mlp.experts.gate_up_proj":
                e, two_i, h = shape
                for x in range(e):
                    for w in ("w1", "w3"):
                        out[f"model.layers.{m.group(1)}.ffn.experts.{x}.{w}.weight"] = (two_i // 2, h)
            elif m is not None and m.group(2) == "mlp.experts.down_proj":
                e, h, i = shape
                for x in range(e):
                    out[f"model.layers.{m.group(1)}.ffn.experts.{x}.w2.weight"] = (h, i)
            else:
                out[file_name(name)] = shape
        return out

    def stack(self, tensors, shapes):
        out = {}
        experts: dict[tuple[str, int, str], torch.Tensor] = {}
        for name, t in tensors.items():
            m = _LAYER.match(name)
            e = _EXPERT.match(m.group(2)) if m is not None else None
            if e is not None:
                experts[(m.group(1), int(e.group(1)), e.group(2))] = t
                continue
            key = model_name(name)
            out[key] = t.float() if _FLOAT32.search(key) else t
        for name, shape in shapes.items():
            m = _LAYER.match(name)
            if m is not None and m.group(2) == "mlp.experts.gate_up_proj":
                i = m.group(1)
                out[name] = torch.stack([torch.cat([experts[(i, x, "w1")], experts[(i, x, "w3")]]) for x in range(shape[0])])
            elif m is not None and m.group(2) == "mlp.experts.down_proj":
                out[name] = torch.stack([experts[(m.group(1), x, "w2")] for x in range(shape[0])])
        return out

    def unstack(self, tensors, cfg):
        out = {}
        for name, t in tensors.items():
            m = _LAYER.match(name)
            if m is not None and m.group(2) == "mlp.experts.gate_up_proj":
                i = t.shape[1] // 2
                for x in range(t.shape[0]):
                    out[f"model.layers.{m.group(1)}.ffn.experts.{x}.w1.weight"] = t[x, :i].contiguous()
                    out[f"model.layers.{m.group(1)}.ffn.experts.{x}.w3.weight"] = t[x, i:].contiguous()
            elif m is not None and m.group(2) == "mlp.experts.down_proj":
                for x in range(t.shape[0]):
                    out[f"model.layers.{m.group(1)}.ffn.experts.{x}.w2.weight"] = t[x].contiguous()
            else:
                out[file_name(name)] = t
        return out

    def gguf_tensors(self):
        return {}

    def megatron_tensors(self):
        """None: the Megatron learner does not build DeepSeek-V4's layers."""
        return None


FAMILY = DeepseekV4("DeepseekV4ForCausalLM", "deepseek_v4", False, "none", 1048576, 512, "none", 1e-6, False, 10000.0,
                    moe_kind="deepseek", rank=19, per_expert=PER_EXPERT,
                    integers=re.compile(r"\.tid2eid$"))  # the hash routing table

"""LoRA adapters on a model's linear layers, applied from outside (`apply_lora`), never merged into the base.

A targeted linear layer (a Linear, or the QuantizedLinear a precision recipe put in its place: the base may be
quantized, the adapter is not) gets two float32 matrices, `lora_A.weight` [r, K] and `lora_B.weight` [N, r]
(Hugging Face PEFT's names and shapes: `model.layers.0.self_attn.q_proj.lora_A.weight`), and a forward hook that
adds the adapter's product to the layer's output. Everything else in the model is frozen: the optimizer holds
state for the adapters alone, and a weight version differs from the last in the adapters alone.

The product has one fixed schedule, run by nemo_rz's consistent ops on the learner and on both rollout engines
(so it is row-invariant and gives the same bits there; `adapter_product`):

    t = ops.linear(float32(x), A)        float32 [.., r]   (A is float32; accumulation in float32)
    t = compute_dtype(t * scale)         one rounding, to the model's compute dtype (x's)
    u = ops.linear(float32(t), B)        float32 [.., N]
    y = base(x) + compute_dtype(u)       the addition in the compute dtype

scale = alpha / r, or alpha / sqrt(r) with rsLoRA. Dropout is 0. A starts as PEFT's (Kaiming-uniform, a =
sqrt(5)), B at zero, so a fresh adapter leaves the model's outputs unchanged.

`lora.modules` names the targets by their Hugging Face module names (q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj, experts.gate_up_proj, experts.down_proj, comma-separated) or a group: attention, mlp, experts
(both expert products), all (all of them; on a dense model the experts match nothing).

MoE experts (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3's routed experts, gpt-oss; quantized or not): each targeted expert
product (the stacked `experts.gate_up_proj` / `experts.down_proj` weights) gets `lora_A.weight` [E, r, in] and
`lora_B.weight` [E, out, r] (expert e's A and B), or with lora.expert_a = shared one A [r, in] for every expert and B
per expert, under `...mlp.experts.adapters.gate_up_proj.lora_A.weight`. A (token, expert) row takes the same
schedule as a dense layer's, its products through the experts' row-invariant ones (ops.expert_linear; a shared A
through ops.linear), so its bits depend on the row and its expert alone (`expert_adapter_product`):

    t = ops.expert_linear(float32(rows), experts, A^T)     float32 [M, r]   (shared A: ops.linear(float32(rows), A))
    t = compute_dtype(t * scale)                           one rounding, to the compute dtype
    u = ops.expert_linear(float32(t), experts, B^T)        float32 [M, out]
    y = product(rows) + compute_dtype(u)                   the addition in the compute dtype

The experts call it through their product hook (models/moe.py `adapted`); a precision recipe's quantized experts
hand it the rows before quantization, as a LoRA hook on a QuantizedLinear sees its input.

PEFT adapter directories (adapter_config.json, adapter_model.safetensors) load (`load_peft`) and save
(`save_peft`) as peft writes them; experts as peft's `target_parameters` (one ParamWrapper per targeted stacked
weight, nested in the module's parameter order: `experts.base_layer.lora_A.weight` is gate_up_proj's when both
are targeted; A [E * r, in] with expert e's rows at e * r, B [out, r * E] with expert e's column j at j * E + e).
A shared A is saved replicated per expert (peft has no shared A), so it loads back per expert.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.models.layers import forward_layout

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # the experts' stacked weights, in their parameter order
EXPERTS = tuple(f"experts.{w}" for w in EXPERT_WEIGHTS)
GROUPS = {"attention": ATTENTION, "mlp": MLP, "experts": EXPERTS, "all": ATTENTION + MLP + EXPERTS}
EXPERT_A = ("per_expert", "shared")
ADAPTER_NAMES = ("lora_A", "lora_B")  # a module's adapter children; their `.weight` tensors are the adapter
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names in its files


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank 0: no adapters. modules: a group name or comma-separated module names (see the module docstring)."""

    rank: int = 0
    alpha: float = 16.0
    rslora: bool = False
    modules: str = "all"
    expert_a: str = "per_expert"  # MoE experts: an A per expert, or one A shared by the experts (B per expert)

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank = {self.rank!r}: use an integer >= 0 (0 = no adapters)")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha = {self.alpha!r}: use a finite number > 0")
        if self.expert_a not in EXPERT_A:
            raise ValueError(f"lora.expert_a = {self.expert_a!r}: use per_expert or shared")
        self.targets  # noqa: B018  (checks the names)

    @classmethod
    def of(cls, spec: "LoraSpec | dict | None") -> "LoraSpec":
        if spec is None:
            return cls()
        if isinstance(spec, LoraSpec):
            return spec
        return cls(**{k: v for k, v in dict(spec).items() if k in {f.name for f in dataclasses.fields(cls)}})

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def targets(self) -> tuple[str, ...]:
        names = tuple(n.strip() for n in str(self.modules).split(",") if n.strip())
        bad = [n for n in names if n not in GROUPS["all"] and n not in GROUPS]
        if not names or bad:
            raise ValueError(f"lora.modules = {self.modules!r}: use attention, mlp, experts, all, or comma-separated "
                             f"names from {', '.join(GROUPS['all'])}")
        wanted = {t for n in names for t in GROUPS.get(n, (n,))}
        return tuple(t for t in GROUPS["all"] if t in wanted)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Matrix(nn.Module):
    """One adapter matrix as the `weight` of a module (so state dicts say `lora_A.weight`, as PEFT's do), held as
    a Linear weight is: [n_out, n_in] over contiguous [n_in, n_out] storage, the GEMM operand ops.linear wants."""

    def __init__(self, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(forward_layout(n_out, n_in, torch.float32))


class _Stack(nn.Module):
    """Per-expert adapter matrices as one `weight` [E, n_out, n_in] over contiguous [E, n_in, n_out] storage: its
    transpose is the [E, in, out] operand ops.expert_linear takes, with no copy."""

    def __init__(self, n_experts: int, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_in, n_out, dtype=torch.float32).transpose(1, 2))


class _ExpertAdapter(nn.Module):
    """The adapter of one expert product: lora_A (a _Stack [E, r, in], or a shared _Matrix [r, in]), lora_B [E, out, r]."""

    def __init__(self, n_experts: int, rank: int, n_in: int, n_out: int, shared_a: bool):
        super().__init__()
        self.lora_A = _Matrix(rank, n_in) if shared_a else _Stack(n_experts, rank, n_in)
        self.lora_B = _Stack(n_experts, n_out, rank)


def adapter_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The adapter's term of y = base(x) + u, in x's dtype, by the module's one schedule."""
    t = ops.linear(x if x.dtype == torch.float32 else x.float(), a) * scale
    if x.dtype != torch.float32:
        t = t.to(x.dtype).float()  # the one rounding of t, to the compute dtype
    u = ops.linear(t, b)
    return u if u.dtype == x.dtype else u.to(x.dtype)


def expert_adapter_product(rows: torch.Tensor, which: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """The adapter's term of an expert product, in rows' dtype: row m of rows [M, in] through expert which[m]'s A
    (a [E, r, in], or a shared [r, in]) and B (b [E, out, r]), by the module's one schedule."""
    x = rows if rows.dtype == torch.float32 else rows.float()
    t = (ops.linear(x, a) if a.dim() == 2 else ops.expert_linear(x, which, a.transpose(1, 2))) * scale
    if rows.dtype != torch.float32:
        t = t.to(rows.dtype).float()  # the one rounding of t, to the compute dtype
    u = ops.expert_linear(t, which, b.transpose(1, 2))
    return u if u.dtype == rows.dtype else u.to(rows.dtype)


def _add_adapter(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + adapter_product(inputs[0], module.lora_A.weight, module.lora_B.weight, module.lora_scale)


def _add_expert_adapter(experts: nn.Module, name: str, rows: torch.Tensor, which: torch.Tensor,
                        y: torch.Tensor) -> torch.Tensor:
    """The experts' product hook (models/moe.py `adapted`): y plus the adapter's term of product `name`, if adapted."""
    adapter = experts.adapters[name] if name in experts.adapters else None
    if adapter is None:
        return y
    return y + expert_adapter_product(rows, which, adapter.lora_A.weight, adapter.lora_B.weight, experts.lora_scale)


def _linear_layers(model: nn.Module):
    """(qualified name, module) of every linear layer by its shape: a `weight` [N, K] parameter and a forward of
    x [.., K] -> [.., N] (Linear, QuantizedLinear); MoE experts hold 3-d weights and are not among them."""
    from nemo_rz.models.layers import Linear
    from nemo_rz.quant.linear import QuantizedLinear

    for name, module in model.named_modules():
        if isinstance(module, (Linear, QuantizedLinear)):
            yield name, module


def _expert_layers(model: nn.Module):
    """(qualified name, module) of every MoE experts module (stacked 3-d expert weights: models/moe.py's, or the
    quantized experts a precision recipe put in their place)."""
    from nemo_rz.models.moe import GptOssExperts, Qwen3MoeExperts
    from nemo_rz.quant.experts import QuantizedExperts

    for name, module in model.named_modules():
        if isinstance(module, (Qwen3MoeExperts, GptOssExperts, QuantizedExperts)):
            yield name, module


def _expert_dims(experts: nn.Module, weight: str) -> tuple[int, int, int]:
    """(experts, in, out) of one stacked expert weight ([E, out, in] or [E, in, out], by the module's `out_in`)."""
    e, d1, d2 = getattr(experts, weight).shape
    return (e, d2, d1) if experts.out_in else (e, d1, d2)


def _init(a: torch.Tensor, b: torch.Tensor, n_in: int, gen: torch.Generator | None) -> None:
    """PEFT's init: A Kaiming-uniform (a = sqrt(5), bound 1/sqrt(K)), B zero."""
    with torch.no_grad():
        bound = 1.0 / math.sqrt(n_in)
        a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=gen))
        b.zero_()


def apply_lora(model: nn.Module, spec: "LoraSpec | dict | None", seed: int | None = None) -> nn.Module:
    """Give every targeted linear layer of `model` an adapter and freeze everything else, in place; returns the
    model (unchanged for rank 0). `seed`: A's initialization draws from its own generator (default: torch's)."""
    spec = LoraSpec.of(spec)
    if not spec.enabled:
        return model
    if adapted(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    layers = [(n, m) for n, m in _linear_layers(model) if n.rsplit(".", 1)[-1] in spec.targets]
    weights = [w for w in EXPERT_WEIGHTS if f"experts.{w}" in spec.targets]
    experts = [(n, m) for n, m in _expert_layers(model)] if weights else []
    if not layers and not experts:
        raise ValueError(f"lora.modules = {spec.modules!r}: the model has no such linear layers or MoE experts "
                         f"(choose among {', '.join(GROUPS['all'])})")
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for _, m in layers:
        n_out, n_in = m.weight.shape
        m.lora_A, m.lora_B = _Matrix(spec.rank, n_in), _Matrix(n_out, spec.rank)
        _init(m.lora_A.weight, m.lora_B.weight, n_in, gen)
        m.lora_scale = spec.scale
        m.register_forward_hook(_add_adapter)
    for _, m in experts:
        m.adapters = nn.ModuleDict()
        for w in weights:
            e, n_in, n_out = _expert_dims(m, w)
            m.adapters[w] = _ExpertAdapter(e, spec.rank, n_in, n_out, spec.expert_a == "shared")
            _init(m.adapters[w].lora_A.weight, m.adapters[w].lora_B.weight, n_in, gen)
        m.lora_scale = spec.scale
        m.product_hook = _add_expert_adapter
    model.lora_spec = spec
    return model


def adapted(model: nn.Module) -> bool:
    return getattr(model, "lora_spec", None) is not None


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor's (`...q_proj.lora_A.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_NAMES


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors by state-dict name (the model's own, not copies)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter(k)}


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """A whole state dict (strict), or, on a model with adapters, the adapter's tensors alone: copied in place,
    the base untouched (what a rollout engine receives between versions)."""
    if not adapted(model) or not state_dict or not all(is_adapter(k) for k in state_dict):
        model.load_state_dict(state_dict, strict=True)
        return
    own = adapter_state(model)
    if set(state_dict) != set(own):
        missing, extra = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        raise ValueError(f"LoRA adapter update does not match the model's adapters (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); send every adapter tensor")
    with torch.no_grad():
        for k, v in state_dict.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"LoRA adapter update: {k} has shape {list(v.shape)}, the model's is {list(own[k].shape)}")
            if not torch.isfinite(v).all():
                raise ValueError(f"LoRA adapter update: {k} holds non-finite values")
            own[k].copy_(v)


def merged_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base state dict with each adapter merged in, W + scale * B @ A rounded to the base's dtype (or `dtype`):
    what a merged-weight refit ships. nemo-rz never runs it; tests use it as the negative control."""
    out = {k: v for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, m in _linear_layers(model):
        if hasattr(m, "lora_A"):
            w = m.weight.detach()
            delta = m.lora_scale * (m.lora_B.weight.detach().double() @ m.lora_A.weight.detach().double())
            out[f"{name}.weight"] = (w.double() + delta).to(dtype or w.dtype)
    for name, m in _expert_layers(model):
        for w_name, adapter in getattr(m, "adapters", {}).items():
            w = getattr(m, w_name).detach()
            a, b = adapter.lora_A.weight.detach().double(), adapter.lora_B.weight.detach().double()
            delta = m.lora_scale * (b @ a)  # [E, out, in] (a shared A broadcasts)
            out[f"{name}.{w_name}"] = (w.double() + (delta if m.out_in else delta.transpose(1, 2))).to(dtype or w.dtype)
    return out


# -- PEFT adapter directories ----------------------------------------------------------------------------------
def _peft_targets(cfg: dict, where: Path) -> tuple[str, ...]:
    dense = cfg.get("target_modules") or ()
    if isinstance(dense, str):
        dense = GROUPS["attention"] + GROUPS["mlp"] if dense == "all-linear" else [dense]
    experts = []
    for p in cfg.get("target_parameters") or ():
        hit = [t for t in EXPERTS if p == t or p.endswith("." + t)]
        if not hit:
            raise ValueError(f"{where}: target_parameters entry {p!r} is not an MoE experts weight "
                             f"({', '.join(EXPERTS)}); only those load")
        experts += hit
    if not set(dense) <= set(ATTENTION + MLP) or not (dense or experts):
        raise ValueError(f"{where}: target_modules {list(dense)!r} are not among {', '.join(ATTENTION + MLP)} "
                         "(a regex or other modules cannot load); save the adapter with a list of those names")
    return tuple(t for t in GROUPS["all"] if t in set(dense) | set(experts))


def _peft_expert_names(targets: tuple[str, ...]) -> dict[str, str]:
    """{the infix peft writes between `...experts.` and `lora_A`: the targeted weight}: ParamWrappers nest in the
    module's parameter order, the first targeted weight innermost (the most `base_layer.`s)."""
    weights = [w for w in EXPERT_WEIGHTS if f"experts.{w}" in targets]
    return {"base_layer." * (len(weights) - 1 - i): w for i, w in enumerate(weights)}


def _from_peft_expert(kind: str, v: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    """peft's fused layout of one expert weight's A [E * r, in] or B [out, r * E] -> nemo-rz's [E, r, in] / [E, out, r]."""
    if v.dim() != 2 or v.shape[0 if kind == "lora_A" else 1] % rank:
        raise ValueError(f"{name}: shape {list(v.shape)} is not peft's fused expert layout for rank {rank}")
    if kind == "lora_A":
        return v.reshape(v.shape[0] // rank, rank, v.shape[1])
    return v.reshape(v.shape[0], rank, v.shape[1] // rank).permute(2, 0, 1)


def _to_peft_expert(kind: str, v: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The inverse of _from_peft_expert; a shared A [r, in] is written once per expert."""
    if kind == "lora_A":
        a = v.expand(n_experts, *v.shape) if v.dim() == 2 else v
        return a.reshape(-1, a.shape[-1]).contiguous()
    return v.permute(1, 2, 0).reshape(v.shape[1], -1).contiguous()


def load_peft(path: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA directory: its spec and its tensors under the base model's names (float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights_file.is_file():
        raise ValueError(f"lora.init_from = {path}: not a PEFT adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    cfg = json.loads(cfg_file.read_text())
    where = cfg_file
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters load")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("rank_pattern", {}),
                    ("alpha_pattern", {}), ("layers_to_transform", None), ("modules_to_save", None)):
        value = cfg.get(key, ok)
        if value not in (ok, None, {}, [], False) or (ok is False and value):
            raise ValueError(f"{where}: {key} = {value!r} is not supported (only plain LoRA: {key} = {ok!r})")
    spec = LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), rslora=bool(cfg.get("use_rslora", False)),
                    modules=",".join(_peft_targets(cfg, where)))
    infixes = _peft_expert_names(spec.targets)
    tensors = {}
    for k, v in load_file(weights_file).items():
        name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if not is_adapter(name):
            raise ValueError(f"{weights_file}: tensor {k!r} is not a LoRA A or B matrix")
        if not torch.isfinite(v).all():
            raise ValueError(f"{weights_file}: tensor {k!r} holds non-finite values")
        module, _, rest = name.partition(".experts.")
        if rest:  # an expert weight's adapter: `...experts.[base_layer.]*lora_A.weight`
            infix, kind = rest[: -len("lora_A.weight")], rest.split(".")[-2]
            if infix not in infixes:
                raise ValueError(f"{weights_file}: tensor {k!r} matches none of the targeted expert weights "
                                 f"{', '.join(infixes.values())}")
            name, v = f"{module}.experts.adapters.{infixes[infix]}.{kind}.weight", _from_peft_expert(kind, v, spec.rank, k)
        tensors[name] = v.float()
    return spec, tensors


def init_from(model: nn.Module, path: str | Path) -> None:
    """Load a PEFT adapter into a model with adapters of the same rank, scale and modules (lora.init_from); a model
    with a shared expert A cannot take peft's per-expert A."""
    spec, tensors = load_peft(path)
    own: LoraSpec = model.lora_spec
    if (spec.rank, spec.scale, set(spec.targets)) != (own.rank, own.scale, set(own.targets)):
        raise ValueError(f"lora.init_from = {path}: the adapter has rank {spec.rank}, alpha {spec.alpha:g}, rslora "
                         f"{str(spec.rslora).lower()}, modules {','.join(spec.targets)}; set lora.rank, lora.alpha, "
                         "lora.rslora and lora.modules to match")
    if own.expert_a != "per_expert" and any(t in own.targets for t in EXPERTS):
        raise ValueError(f"lora.init_from = {path}: a PEFT adapter holds an A per expert; set lora.expert_a=per_expert")
    load_weights(model, tensors)


def save_peft(model: nn.Module, path: str | Path, base_model: str | None = None) -> Path:
    """Write the model's adapters as a PEFT LoRA directory (peft's PeftModel.from_pretrained loads it)."""
    from safetensors.torch import save_file

    spec: LoraSpec = model.lora_spec
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dense = [t for t in spec.targets if t not in EXPERTS]
    experts = {name: m for name, m in _expert_layers(model) if getattr(m, "adapters", None)}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
              "lora_alpha": spec.alpha, "use_rslora": spec.rslora, "target_modules": dense,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    if experts:
        config["target_parameters"] = [t for t in spec.targets if t in EXPERTS]
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    infix = {w: i for i, w in _peft_expert_names(spec.targets).items()}
    out = {}
    for k, v in adapter_state(model).items():
        module, _, rest = k.partition(".experts.adapters.")
        if rest:  # `<weight>.lora_A.weight` -> peft's nested name and fused layout
            weight, kind, _ = rest.split(".")
            n_experts = getattr(experts[f"{module}.experts"], weight).shape[0]
            k, v = f"{module}.experts.{infix[weight]}{kind}.weight", _to_peft_expert(kind, v, n_experts)
        out[PEFT_PREFIX + k] = v.detach().contiguous()
    save_file(out, str(path / WEIGHTS_FILE))
    return path

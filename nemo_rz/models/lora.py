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
up_proj, down_proj, comma-separated) or a group: attention, mlp, all. MoE experts are not adapted.

PEFT adapter directories (adapter_config.json, adapter_model.safetensors) load (`load_peft`) and save
(`save_peft`) as peft writes them.
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
GROUPS = {"attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP}
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

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank = {self.rank!r}: use an integer >= 0 (0 = no adapters)")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha = {self.alpha!r}: use a finite number > 0")
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
        if self.modules in GROUPS:
            return GROUPS[self.modules]
        names = tuple(n.strip() for n in str(self.modules).split(",") if n.strip())
        bad = [n for n in names if n not in GROUPS["all"]]
        if not names or bad:
            raise ValueError(f"lora.modules = {self.modules!r}: use attention, mlp, all, or comma-separated names "
                             f"from {', '.join(GROUPS['all'])}")
        return tuple(dict.fromkeys(names))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Matrix(nn.Module):
    """One adapter matrix as the `weight` of a module (so state dicts say `lora_A.weight`, as PEFT's do), held as
    a Linear weight is: [n_out, n_in] over contiguous [n_in, n_out] storage, the GEMM operand ops.linear wants."""

    def __init__(self, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(forward_layout(n_out, n_in, torch.float32))


def adapter_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The adapter's term of y = base(x) + u, in x's dtype, by the module's one schedule."""
    t = ops.linear(x if x.dtype == torch.float32 else x.float(), a) * scale
    if x.dtype != torch.float32:
        t = t.to(x.dtype).float()  # the one rounding of t, to the compute dtype
    u = ops.linear(t, b)
    return u if u.dtype == x.dtype else u.to(x.dtype)


def _add_adapter(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + adapter_product(inputs[0], module.lora_A.weight, module.lora_B.weight, module.lora_scale)


def _linear_layers(model: nn.Module):
    """(qualified name, module) of every linear layer by its shape: a `weight` [N, K] parameter and a forward of
    x [.., K] -> [.., N] (Linear, QuantizedLinear); MoE experts hold 3-d weights and are not among them."""
    from nemo_rz.models.layers import Linear
    from nemo_rz.quant.linear import QuantizedLinear

    for name, module in model.named_modules():
        if isinstance(module, (Linear, QuantizedLinear)):
            yield name, module


def apply_lora(model: nn.Module, spec: "LoraSpec | dict | None", seed: int | None = None) -> nn.Module:
    """Give every targeted linear layer of `model` an adapter and freeze everything else, in place; returns the
    model (unchanged for rank 0). `seed`: A's initialization draws from its own generator (default: torch's)."""
    spec = LoraSpec.of(spec)
    if not spec.enabled:
        return model
    if adapted(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    layers = [(n, m) for n, m in _linear_layers(model) if n.rsplit(".", 1)[-1] in spec.targets]
    if not layers:
        raise ValueError(f"lora.modules = {spec.modules!r}: the model has no such linear layers "
                         f"(its MoE experts are not adapted; choose among {', '.join(GROUPS['all'])})")
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for _, m in layers:
        n_out, n_in = m.weight.shape
        m.lora_A, m.lora_B = _Matrix(spec.rank, n_in), _Matrix(n_out, spec.rank)
        with torch.no_grad():  # PEFT's init: A Kaiming-uniform (a = sqrt(5), bound 1/sqrt(K)), B zero
            bound = 1.0 / math.sqrt(n_in)
            m.lora_A.weight.copy_(torch.empty(spec.rank, n_in).uniform_(-bound, bound, generator=gen))
            m.lora_B.weight.zero_()
        m.lora_scale = spec.scale
        m.register_forward_hook(_add_adapter)
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
    return out


# -- PEFT adapter directories ----------------------------------------------------------------------------------
def _peft_targets(cfg: dict, where: Path) -> tuple[str, ...]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = GROUPS["all"] if targets == "all-linear" else [targets]
    names = tuple(sorted(set(targets or ()), key=GROUPS["all"].index)) if set(targets or ()) <= set(GROUPS["all"]) else None
    if not names:
        raise ValueError(f"{where}: target_modules {targets!r} are not among {', '.join(GROUPS['all'])} "
                         "(a regex or other modules cannot load); save the adapter with a list of those names")
    return names


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
    tensors = {}
    for k, v in load_file(weights_file).items():
        name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if not is_adapter(name):
            raise ValueError(f"{weights_file}: tensor {k!r} is not a LoRA A or B matrix")
        if not torch.isfinite(v).all():
            raise ValueError(f"{weights_file}: tensor {k!r} holds non-finite values")
        tensors[name] = v.float()
    return spec, tensors


def init_from(model: nn.Module, path: str | Path) -> None:
    """Load a PEFT adapter into a model with adapters of the same rank, scale and modules (lora.init_from)."""
    spec, tensors = load_peft(path)
    own: LoraSpec = model.lora_spec
    if (spec.rank, spec.scale, set(spec.targets)) != (own.rank, own.scale, set(own.targets)):
        raise ValueError(f"lora.init_from = {path}: the adapter has rank {spec.rank}, alpha {spec.alpha:g}, rslora "
                         f"{str(spec.rslora).lower()}, modules {','.join(spec.targets)}; set lora.rank, lora.alpha, "
                         "lora.rslora and lora.modules to match")
    load_weights(model, tensors)


def save_peft(model: nn.Module, path: str | Path, base_model: str | None = None) -> Path:
    """Write the model's adapters as a PEFT LoRA directory (peft's PeftModel.from_pretrained loads it)."""
    from safetensors.torch import save_file

    spec: LoraSpec = model.lora_spec
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
              "lora_alpha": spec.alpha, "use_rslora": spec.rslora, "target_modules": list(spec.targets),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file({PEFT_PREFIX + k: v.detach().contiguous() for k, v in adapter_state(model).items()}, str(path / WEIGHTS_FILE))
    return path

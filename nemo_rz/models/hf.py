"""Hugging Face checkpoint I/O: directories of the supported families (models/hf_config.py: Qwen3, Qwen2, Llama,
Mistral, Qwen3-MoE, gpt-oss, Gemma 3) <-> Decoder (and .gguf files -> Decoder). The config.json translation is in
models/hf_config.py; this module reads and writes the tensors.

A checkpoint directory holds config.json plus model.safetensors (or model.safetensors.index.json and its
shards). Decoder's parameter names already follow the Hugging Face layout, so loading is a check (names,
shapes, finiteness) and a copy. What differs per family (the tensors files hold that are not parameters, and
how experts are laid out in files: Qwen3-MoE's one tensor per expert, stacked in memory) is the family's
(nemo_rz.models.families: Family.ignored, per_expert, file_shapes, stack, unstack).

Only json, safetensors and torch are used here: importing nemo_rz.models never imports transformers.

Every problem with a file raises ModelFileError (a ValueError) with one line: what is wrong, in which file,
what to do. save_hf writes into a temporary directory beside the target and swaps it in with a rename, so an
interrupted save never leaves a half-written checkpoint and never damages the one already there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_rz import atomic
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.families import qwen3_moe
from nemo_rz.models.hf_config import CONFIG_FILE, ModelFileError, architecture_of, config_from_hf, hf_config
from nemo_rz.models.layers import laid_out_like

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_FLOAT = {"F64", "F32", "F16", "BF16"}
_SAFETENSORS_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_NAMES_SHOWN = 3


# -- loading -----------------------------------------------------------------------------------------------
JSON_MAX_BYTES = 64 << 20  # config.json and the shard index are kilobytes to a few megabytes


def read_json(file: Path) -> object:
    try:
        size = file.stat().st_size
        if size > JSON_MAX_BYTES:
            raise ModelFileError(f"{file} is {size} bytes, more than the {JSON_MAX_BYTES} a checkpoint's JSON file can "
                                 "need; it is not a Hugging Face config or index, re-download the checkpoint")
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelFileError(f"cannot read {file}: {e.strerror or e}; check the file and its permissions") from None
    except UnicodeDecodeError:
        raise ModelFileError(f"{file} is not UTF-8 text; re-download or re-save the checkpoint") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(
            f"cannot parse {file}: {e.msg} at line {e.lineno} column {e.colno}; fix or re-download the file"
        ) from None


def _weight_files(root: Path) -> list[Path]:
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelFileError(f"{index} has no valid 'weight_map' object; re-save or re-download the checkpoint")
        files = []
        for name in dict.fromkeys(weight_map.values()):
            shard = root / name
            if not shard.is_file():
                raise ModelFileError(
                    f"shard {name} listed in {index} is missing from {root}; re-download the checkpoint's weights"
                )
            files.append(shard)
        return files
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = (
        f"found only {', '.join(others[:_NAMES_SHOWN])} (PyTorch pickles, not read for safety): re-save with "
        "save_pretrained(path, safe_serialization=True)"
        if others else "save the weights with save_pretrained() or nemo_rz.models.save_hf()"
    )
    raise ModelFileError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}; {hint}")


def _names(items) -> str:
    items = list(items)
    more = f" (+{len(items) - _NAMES_SHOWN} more)" if len(items) > _NAMES_SHOWN else ""
    return ", ".join(items[:_NAMES_SHOWN]) + more


def _family(cfg: DecoderConfig, arch: str | None = None):
    """The family of architecture `arch` (None: the one `cfg` is saved as by default)."""
    from nemo_rz.models import families

    fam = families.by_architecture(arch) if arch is not None else None
    return fam if fam is not None else families.for_config(cfg)


def ignored_tensor(name: str, cfg: DecoderConfig, arch: str | None = None) -> bool:
    """Whether a file tensor is not a parameter (the family's rule, families.base.Family.ignored)."""
    return _family(cfg, arch).ignored(name, cfg)


# -- experts: the family's layout in files (Qwen3-MoE: one tensor per expert; stacked in memory) --------------
PER_EXPERT = qwen3_moe.PER_EXPERT


def _per_expert_shapes(shapes: dict[str, tuple], cfg: DecoderConfig, arch: str | None = None) -> dict[str, tuple]:
    """The file names and shapes of the family's file layout for a model's parameter shapes."""
    return _family(cfg, arch).file_shapes(shapes, cfg)


def stack_experts(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], cfg: DecoderConfig | None = None,
                  arch: str | None = None) -> dict[str, torch.Tensor]:
    """File tensors (per-expert) -> the model's stacked parameters, by the family's layout (cfg None: Qwen3-MoE's)."""
    return (qwen3_moe.FAMILY if cfg is None else _family(cfg, arch)).stack(tensors, shapes)


def _unstack_experts(tensors: dict[str, torch.Tensor], cfg: DecoderConfig, arch: str | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters -> the tensors the family's files hold."""
    return _family(cfg, arch).unstack(tensors, cfg)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers / truncation
        raise ModelFileError(
            f"cannot read {file}: {e}; the file is corrupt or truncated, re-download or re-save it"
        ) from None


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple, str]]:
    """{tensor name: (file, shape, safetensors dtype)} of every tensor in the files' headers, first file wins;
    the weights themselves are not read."""
    found = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if name not in found:
                    sl = f.get_slice(name)
                    found[name] = (file, tuple(sl.get_shape()), sl.get_dtype())
    return found


def _found(files: list[Path], cfg: DecoderConfig, headers: dict | None = None,
           arch: str | None = None) -> dict[str, tuple[Path, tuple, str]]:
    """{tensor name: (file, shape, safetensors dtype)} of every tensor the model could use, first file wins; the
    names as the model spells them where a family's files spell some otherwise (Family.alias)."""
    headers = _headers(files) if headers is None else headers
    alias = _family(cfg, arch).alias
    return {alias(name): entry for name, entry in headers.items() if not ignored_tensor(alias(name), cfg, arch)}


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|router)\.weight$")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks)?$")


def _count(d: dict, key: str) -> int | None:
    value = d.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_counts(d: dict, source: str, headers: dict[str, tuple[Path, tuple, str]], where: str, arch: str) -> None:
    """Refuse a config.json that asks for more layers or experts than the checkpoint's tensors hold, from the
    tensor names and shapes alone, before anything is built: a model of num_hidden_layers = 100000000 would take
    hours to build and fail only then. (Fewer is left to the full check, which names the unexpected tensors.)"""
    layers = _count(d, "num_hidden_layers")
    if layers is not None:
        indices = {int(m.group(1)) for name in headers if (m := _LAYER.match(name))}
        found = max(indices) + 1 if indices else 0
        if layers > found:
            held = f"tensors of {found} layer(s) (model.layers.0 to model.layers.{found - 1})" if found else \
                "no model.layers.N tensors"
            raise ModelFileError(
                f"num_hidden_layers={layers} in {source} is more than the weights hold: {where} has {held}; "
                "fix config.json or re-download the weights"
            )
    from nemo_rz.models import families

    fam = families.by_architecture(arch)
    for key in fam.expert_keys if fam is not None else ():
        experts = _count(d, key)
        if experts is None:
            continue
        sizes = {shape[0] for name, (_, shape, _) in headers.items() if _ROUTER.match(name) and shape}
        sizes |= {shape[0] for name, (_, shape, _) in headers.items() if _STACKED_EXPERTS.match(name) and shape}
        sizes |= {int(m.group(1)) + 1 for name in headers if (m := _EXPERT_INDEX.match(name))}
        found = max(sizes) if sizes else None
        if found is not None and experts > found:
            raise ModelFileError(
                f"{key}={experts} in {source} is more than the weights hold: {where} has tensors of {found} expert(s) "
                "per layer; fix config.json or re-download the weights"
            )
        break  # the first key present is the one config_from_hf reads


def _check(found: dict[str, tuple[tuple, str]], expected: dict[str, tuple], where: str, arch: str, cfg: DecoderConfig) -> None:
    """Names, shapes and float dtypes of the tensors found ({name: (shape, dtype)}) against the model's."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    bad_shape = [f"{n} is {list(shape)} not {list(expected[n])}" for n, (shape, _) in found.items()
                 if n in expected and shape != expected[n]]
    integers = _family(cfg, arch).integers  # a family's integer tensors (DeepSeek-V4's tid2eid)
    bad_type = [f"{n} ({dtype})" for n, (_, dtype) in found.items() if n in expected and dtype not in _SAFETENSORS_FLOAT
                and not (integers is not None and integers.search(n) and dtype in ("I64", "I32"))]
    if missing:
        raise ModelFileError(
            f"{len(missing)} tensor(s) missing from {where}: {_names(missing)}; the weights do not match config.json "
            f"({arch}, {cfg.num_layers} layers) — re-save the checkpoint or fix config.json"
        )
    if extra:
        raise ModelFileError(
            f"{len(extra)} unexpected tensor(s) in {where}: {_names(extra)}; nemo_rz's {arch} decoder has no such "
            "parameters — check config.json matches the weights (layers, tie_word_embeddings, qk-norm, biases)"
        )
    if bad_shape:
        raise ModelFileError(
            f"{len(bad_shape)} tensor(s) with the wrong shape in {where}: {_names(bad_shape)}; config.json does "
            "not match the weights — fix config.json or re-save the checkpoint"
        )
    if bad_type:
        raise ModelFileError(
            f"{len(bad_type)} non-float tensor(s) in {where}: {_names(bad_type)}; nemo_rz loads float weights only"
        )


def _read(files: list[Path], found: dict, convert, alias=None) -> dict[str, torch.Tensor]:
    """convert(name, tensor) of every tensor in `found`, each file opened once (`alias`: the name `found` holds
    for a file's name, Family.alias)."""
    out = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                key = name if alias is None else alias(name)
                if found.get(key, (None,))[0] == file:
                    out[key] = convert(key, f.get_tensor(name))
    return out


def _owned(t: torch.Tensor, cfg: DecoderConfig, like: torch.Tensor | None) -> torch.Tensor:
    # An owned copy: get_tensor's result can sit inside the file's buffer, off the 64-byte alignment that
    # row-invariant BLAS paths and fast SIMD loads expect (and tied to a mapping of the file). In the layout of
    # the parameter `like` it becomes (a Linear weight's [K, N] storage, models/layers.py), where there is one.
    # A float32 tensor of a bfloat16 model (DeepSeek's e_score_correction_bias buffer) stays float32.
    if not t.dtype.is_floating_point:  # an integer table a family declares (Family.integers): kept as it is
        return t.clone(memory_format=torch.contiguous_format)
    dtype = torch.float32 if like is not None and like.dtype == torch.float32 else cfg.torch_dtype
    if like is not None and tuple(like.shape) == tuple(t.shape):
        return laid_out_like(t, like, dtype)
    return t.to(dtype).clone(memory_format=torch.contiguous_format)


def _where(files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"


def _load_tensors(files: list[Path], model: Decoder, arch: str, quantization: dict | None = None,
                  headers: dict | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's parameter names, checked; a quantized checkpoint's weights
    (`quantization`: config.json's quantization_config) decoded exactly to float first. `headers`: the files'
    _headers(), when already read."""
    cfg = model.config
    params = model.state_dict()  # on the meta device: each parameter's shape and layout
    shapes = {name: tuple(t.shape) for name, t in params.items()}
    found = _found(files, cfg, headers, arch)
    fam = _family(cfg, arch)
    where = _where(files)
    if quantization:
        from nemo_rz.quant.checkpoints import dequantized

        try:
            tensors = dequantized(_read(files, found, lambda n, t: t, fam.alias), quantization)
        except ValueError as e:
            raise ModelFileError(f"{where}: {e}") from None
        found = {n: (None, tuple(t.shape), _SAFETENSORS_NAMES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()}
    layout = _family(cfg, arch).per_expert
    per_expert = layout is not None and any(layout.search(name) for name in found)
    expected = _per_expert_shapes(shapes, cfg, arch) if per_expert else shapes
    _check({n: (shape, dtype) for n, (_, shape, dtype) in found.items()}, expected, where, arch, cfg)
    own = lambda n, t: _owned(t, cfg, params.get(n))  # noqa: E731
    out = {n: own(n, t) for n, t in tensors.items()} if quantization else _read(files, found, own, fam.alias)
    nonfinite = [n for n, t in out.items() if not bool(torch.isfinite(t).all())]
    if nonfinite:
        raise ModelFileError(
            f"non-finite values (NaN/Inf) in {len(nonfinite)} tensor(s) in {where}: {_names(nonfinite)}; the "
            "checkpoint is corrupt or from a diverged run — use an earlier checkpoint"
        )
    return stack_experts(out, shapes, cfg, arch) if per_expert else out


def load_hf(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Decoder:
    """A Decoder (eval mode, on CPU) with the weights of a Hugging Face checkpoint directory of a supported family
    (models/hf_config.py) or a .gguf file of a family GGUF files hold (dequantized: nemo_rz.models.gguf).

    dtype: "float32" / "bfloat16" (or the torch dtypes); None keeps the checkpoint's dtype when it is one of
    these and uses float32 otherwise.
    """
    from nemo_rz.models import gguf  # imports the gguf package only when a .gguf file is loaded

    if gguf.is_gguf(path):
        return gguf.load_gguf(path, dtype)
    root = Path(path)
    if not root.exists():
        raise ModelFileError(
            f"model directory {root} does not exist; pass the directory that holds config.json and model.safetensors"
        )
    if not root.is_dir():
        raise ModelFileError(f"{root} is a file, not a checkpoint directory or a .gguf file; pass the directory that holds it")
    config_file = root / CONFIG_FILE
    if not config_file.is_file():
        raise ModelFileError(
            f"no {CONFIG_FILE} in {root}: not a Hugging Face checkpoint directory; save the model with "
            "save_pretrained() or nemo_rz.models.save_hf()"
        )
    d = read_json(config_file)
    if not isinstance(d, dict):
        config_from_hf(d, str(config_file), dtype)  # raises: not a JSON object
    arch = architecture_of(d, str(config_file))
    try:
        files = _weight_files(root)
    except ModelFileError:
        config_from_hf(d, str(config_file), dtype)  # a bad config.json is the first thing to fix
        raise
    headers = _headers(files)
    # before config_from_hf, whose per-layer lists are as long as num_hidden_layers, and before building
    check_counts(d, str(config_file), headers, _where(files), arch)
    cfg = config_from_hf(d, str(config_file), dtype)
    with torch.device("meta"):  # no throw-away random init; the loaded tensors become the parameters
        model = Decoder(cfg)
    state = _load_tensors(files, model, arch, d.get("quantization_config"), headers)
    model.load_state_dict(state, strict=True, assign=True)  # strict: every parameter (and DeepSeek's bias buffer) replaced
    return model.eval()


# -- saving ------------------------------------------------------------------------------------------------
_WEIGHT_NAMES = {CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE}


def _superseded(name: str) -> bool:
    """Files of the old checkpoint that the new weights replace (other files, e.g. the tokenizer, are kept)."""
    return name in _WEIGHT_NAMES or (name.startswith("model-") and name.endswith(".safetensors")) or (
        name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_hf(model: Decoder, path: str | os.PathLike, architecture: str | None = None,
            extra_tensors: dict[str, torch.Tensor] | None = None, extra_config: dict | None = None) -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json + model.safetensors) at `path`, as
    `architecture` (None: the model's natural one, hf_config.architecture_for). `extra_tensors` / `extra_config`:
    file tensors and config.json keys of parts outside the decoder (DeepSeek-V3's MTP layers: models/mtp.py).

    The checkpoint is written to a temporary directory beside `path` and renamed into place, so a failure at
    any point leaves an existing checkpoint at `path` untouched. Other files in an existing directory (tokenizer,
    generation config...) are carried over; old weight files are replaced. Returns the path.
    """
    target = Path(path)
    if target.is_symlink():  # replace the directory the link points to, not the link
        target = target.resolve()
    config = {**hf_config(model.config, architecture), **(extra_config or {})}
    if target.exists() and not target.is_dir():
        raise ModelFileError(f"{target} exists and is a file; pass a directory path for the checkpoint")
    arch = config["architectures"][0]
    tensors = _unstack_experts({name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}, model.config, arch)
    clash = sorted(set(tensors) & set(extra_tensors or {}))
    if clash:
        raise ValueError(f"save_hf: extra tensor {clash[0]} is also one of the model's; name it apart")
    tensors.update(extra_tensors or {})
    with atomic.new_dir(target) as tmp:
        if target.is_dir():
            for entry in target.iterdir():
                if _superseded(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
                elif entry.is_symlink():
                    os.symlink(os.readlink(entry), tmp / entry.name)
                else:
                    _link_or_copy(str(entry), str(tmp / entry.name))
        with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_FILE, 0o666 & ~atomic.umask())  # safetensors writes it private
        atomic.fsync(tmp / WEIGHTS_FILE)
    return target

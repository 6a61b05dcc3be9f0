"""`attngraph.accelerate(model)`: HF `generate` on the paged runtime, everything else unchanged.

transformers' own generation loop keeps doing what it does (logits processors, sampling,
stopping criteria, streamers, ``return_dict_in_generate``); each forward it makes is served by
the `ModelRunner` through a `PagedCache` owned by the call. Each prepared call is checked
before its first forward (`generate_checks`): an option whose result would differ from HF's
is refused by name. A direct ``model(...)`` call without that cache runs the original forward
untouched; ``copy.deepcopy`` gives an un-accelerated copy.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
from typing import Any

import torch
import torch._dynamo
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import CompileConfig
from ..errors import AttnGraphError, UnsupportedGenerationError, UnsupportedModelError
from .decode_loop import paged_sample
from .generate_checks import check_forward_kwargs
from .model_runner import ModelRunner
from .paged_cache import PagedCache, check_token_ids
from .speculative import paged_assisted_decode, paged_lookup_decode
from .tensor_parallel import check_local_heads, check_shardable

logger = logging.getLogger(__name__)

_STATE_ATTR = "_attngraph_state"
#: Dynamo's "recompiled too often" error (an empty tuple catches nothing where it is absent).
_RECOMPILE_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
SUPPORTED_MODES = (
    "greedy decoding and multinomial sampling (temperature, top-k, top-p, logits processors), num_beams=1, "
    "greedy speculative decoding for batches (prompt_lookup_num_tokens, or an accelerated assistant_model), and "
    "other assisted generation at batch size 1 (with sampling, or an assistant_model that cannot be accelerated)"
)


class AcceleratedState:
    """What `accelerate` attached to a model: the runner, the originals, a lock serializing generate."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig) -> None:
        self.config = config
        self.original_forward = model.forward
        self.original_generate = model.generate
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.runner = ModelRunner(model, config)
        self.lock = threading.Lock()


def accelerate(model: torch.nn.Module, config: CompileConfig | None = None, **options: Any) -> torch.nn.Module:
    """Make ``model.generate(...)`` run on attngraph's paged runtime; returns the same model.

    Parameters
    ----------
    model:
        A transformers causal LM (``AutoModelForCausalLM``) whose attention is SDPA or eager.
    config, **options:
        A `CompileConfig` and/or its fields (``attention_backend="triton"``, ``page_size=1``,
        ``kv_cache_tokens=...``).

    The model is compiled once here (on a dummy sequence of ``trace_tokens``), so an
    unsupported model or backend fails now with `UnsupportedModelError` /
    `BackendUnavailableError`. `restore` undoes it.

    Examples
    --------
    >>> model = attngraph.accelerate(model, attention_backend="torch_native")
    >>> out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)
    """
    if getattr(model, _STATE_ATTR, None) is not None:
        raise AttnGraphError("this model is already accelerated; call attngraph.restore(model) first")
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers generation model")
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported by accelerate(); use torch.compile")
    cfg = CompileConfig.from_kwargs(config, **options)
    _check_rope(model)
    world = check_shardable(model)  # tensor parallel: the rank count divides the heads
    state = AcceleratedState(model, cfg)
    try:
        check_local_heads(model, world, state.runner.geometry.num_q_heads, state.runner.geometry.num_kv_heads)
        state.runner.warmup()
    except torch._dynamo.exc.Unsupported as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(
            f"Dynamo cannot trace {type(model).__name__} in the ragged form accelerate() compiles ({first}). "
            "Use the stateless form, torch.compile(model, backend='attngraph'), which allows graph breaks, "
            "or HF's own generate."
        ) from exc
    object.__setattr__(model, _STATE_ATTR, state)
    model.forward = _bind(_forward, model, state.original_forward)
    model.generate = _bind(_generate, model, state.original_generate)
    # copy.deepcopy(model) looks up __deepcopy__ on the instance: an un-accelerated copy.
    model.__dict__["__deepcopy__"] = functools.partial(_deepcopy, model)
    return model


def _rope_types(node: Any) -> set[str]:
    """Every ``rope_type`` in a config's RoPE parameters (a dict, or one dict per layer type)."""
    if isinstance(node, dict):
        found = {str(node[k]) for k in ("rope_type", "type") if isinstance(node.get(k), str)}
        return found.union(*(_rope_types(v) for v in node.values() if isinstance(v, dict)))
    return set()


def _check_rope(model: torch.nn.Module) -> None:
    cfg = model.config
    types = _rope_types(getattr(cfg, "rope_parameters", None)) | _rope_types(getattr(cfg, "rope_scaling", None))
    if "dynamic" in types:
        raise UnsupportedModelError(
            "rope_type='dynamic' is not supported by accelerate(): dynamic NTK RoPE recomputes its frequencies "
            "from the longest position seen at run time (a data-dependent branch, and state carried between "
            "steps), which one compiled ragged graph cannot reproduce. Use the stateless form, "
            "torch.compile(model, backend='attngraph'), or HF's own generate."
        )


def _deepcopy(model: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of an accelerated model: a plain (un-accelerated) copy; the compiled
    graph and the KV pool are not copyable. Accelerate the copy to serve it too."""
    state = state_of(model)
    with state.lock:
        saved = {k: model.__dict__.pop(k) for k in ("forward", "generate", "__deepcopy__", _STATE_ATTR) if k in model.__dict__}
        try:
            return copy.deepcopy(model, memo)
        finally:
            model.__dict__.update(saved)


def _bind(fn, model: torch.nn.Module, original):
    """``fn`` bound to ``model``, showing ``original``'s signature: transformers inspects
    ``forward``'s parameters (``logits_to_keep``, the cache's name) to decide what to pass."""
    bound = functools.partial(fn, model)
    return functools.update_wrapper(bound, original)


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `accelerate`: the original forward and generate, the KV pool released."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    with state.lock:
        for name in ("forward", "generate", "__deepcopy__"):
            model.__dict__.pop(name, None)
        object.__delattr__(model, _STATE_ATTR)
        state.runner.release()
    return model


def state_of(model: torch.nn.Module) -> AcceleratedState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise AttnGraphError("model is not accelerated; call attngraph.accelerate(model) first")
    return state


def _check_generate_options(model: torch.nn.Module, state: AcceleratedState, kwargs: dict) -> None:
    gen_cfg = kwargs.get("generation_config") or model.generation_config

    def opt(name: str, default: Any = None) -> Any:
        return kwargs.get(name, getattr(gen_cfg, name, default))

    problems = []
    if (opt("num_beams", 1) or 1) > 1:
        problems.append(f"beam search (num_beams={opt('num_beams')})")
    if kwargs.get("assistant_model") is model:
        problems.append("the model as its own assistant_model (use prompt_lookup_num_tokens, or a smaller draft model)")
    if _assisted(model, kwargs) and opt("use_cache", True) is False:
        problems.append("assisted generation with use_cache=False (transformers refuses it too: it crops a cache)")
    if opt("penalty_alpha") is not None and (opt("top_k") or 0) > 1:
        problems.append("contrastive search")
    if kwargs.get("inputs_embeds") is not None:
        problems.append("inputs_embeds (pass input_ids)")
    for name in ("cache", "past_key_values"):
        given = kwargs.get(name)
        if given is None:
            continue
        if not isinstance(given, PagedCache) or given.runner is not state.runner:
            problems.append(
                f"a user-supplied {name} (the accelerated generate manages its own paged cache; it takes back only "
                "the PagedCache an earlier call of this model returned, as transformers' assisted decoding does "
                "with its assistant)"
            )
        elif given.columns > 0 and not given.rows:
            problems.append(f"a {name} whose pages were already given back (PagedCache.free)")
    if kwargs.get("synced_gpus"):
        problems.append("synced_gpus (one process serves the paged runtime)")
    if kwargs.get("custom_generate") is not None:
        problems.append("custom_generate (attngraph supplies its own decoding loop)")
    if kwargs.get("cache_implementation") is not None:
        problems.append(f"cache_implementation={kwargs['cache_implementation']!r} (the KV cache is attngraph's paged pool)")
    if problems:
        raise UnsupportedGenerationError(
            "attngraph's accelerated generate does not support " + "; ".join(problems)
            + f". Supported: {SUPPORTED_MODES}. For other modes call attngraph.restore(model) first "
            "(HF's own generate) or use the original model."
        )


def _check_model_state(model: torch.nn.Module, state: AcceleratedState) -> None:
    """The model must still be what `accelerate` compiled: same dtype and device (the KV pool
    and the graph were built for them), and in eval mode (train mode would trace dropout)."""
    runner = state.runner
    param = next(model.parameters())
    if (param.dtype, param.device) != (runner.dtype, runner.device):
        raise AttnGraphError(
            f"the model moved to {param.dtype} on {param.device} after attngraph.accelerate(), which compiled it "
            f"and sized its KV pool for {runner.dtype} on {runner.device}; call attngraph.restore(model) and "
            "attngraph.accelerate(model) again after .to(...)"
        )
    if model.training:
        raise UnsupportedGenerationError(
            "the model is in training mode (dropout active): attngraph's accelerated generate serves eval mode "
            "only; call model.eval() first"
        )


def _generate(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = state_of(model)
    _check_generate_options(model, state, kwargs)
    _check_model_state(model, state)
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(ids, torch.Tensor):
        check_token_ids(ids, state.runner.device, "input_ids")
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    given = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
    # The cache outlives the call when the caller threads it on: transformers' assisted decoding
    # passes the assistant's cache back each round (and crops it); its pages go back to the
    # pool when the last reference to it is dropped.
    keep = given is not None or bool(getattr(gen_cfg, "is_assistant", False))
    with state.lock:  # one generate at a time per model: the runner's step state is shared
        cache = given if given is not None else PagedCache(state.runner)
        try:
            # HF prepares everything, then calls attngraph's decoding loop, which checks the
            # prepared call and runs its own loop or HF's (streamers, return_dict_in_generate,
            # custom stopping criteria, use_cache=False), both on the paged runtime. A callable
            # custom_generate receives no streamer from transformers: it is passed again by a
            # keyword of the loop's own.
            loop = {"custom_generate": paged_sample, "attngraph_streamer": kwargs.get("streamer")}
            assistant = kwargs.get("assistant_model")
            if assistant is not None:
                _accelerate_assistant(model, state, assistant)
            if assistant is not None and _own_assisted_loop(model, assistant, kwargs):
                # Greedy with an accelerated assistant of the same vocabulary: attngraph's
                # speculative loop (batches, ragged steps on both pools), or HF's assisted loop
                # for what that one does not reproduce. transformers hands a callable loop no
                # assistant_model: it goes under a keyword of the loop's own.
                loop = {"custom_generate": paged_assisted_decode, "attngraph_streamer": kwargs.get("streamer"),
                        "attngraph_assistant": assistant}  # fmt: skip
            elif assistant is not None:
                # HF's own assisted loop: candidates from the assistant, verified k + 1 tokens at
                # a time through this model's paged forward, rejected tokens dropped with
                # PagedCache.crop. A callable custom_generate would not receive the assistant.
                loop = {}
            elif _assisted(model, kwargs):
                # Prompt lookup: attngraph's speculative loop (batches, ragged verify steps), or
                # HF's assisted loop for what that one does not reproduce (sampling, processors).
                loop = {"custom_generate": paged_lookup_decode, "attngraph_streamer": kwargs.get("streamer")}
            kwargs = _without_cache_implementation(model, kwargs)
            out = state.original_generate(*args, **{state.cache_kwarg: cache}, **loop, **kwargs)
            state.runner.check_kernel_faults()  # a read from the device only where a kernel keeps a fault count
            if assistant is not None and getattr(assistant, _STATE_ATTR, None) is not None:
                state_of(assistant).runner.check_kernel_faults()
            return out
        except _RECOMPILE_LIMIT_HIT as exc:
            raise UnsupportedModelError(
                "the accelerated model's graph was recompiled more often than Dynamo allows "
                "(torch._dynamo.config.recompile_limit): something the graph depends on keeps changing between "
                "calls. Call attngraph.restore(model) and attngraph.accelerate(model) again after changing the model."
            ) from exc
        finally:
            if not keep:
                cache.free()


def _accelerate_assistant(model: torch.nn.Module, state: AcceleratedState, assistant: torch.nn.Module) -> None:
    """Accelerate an ``assistant_model`` that is not accelerated yet, in place, with this
    model's config (backend: ``draft_attention_backend``, else ``attention_backend``; a pool of
    as many tokens as this model's). It stays accelerated for later calls (`restore` undoes
    it). One that cannot be (another device, an unsupported model) is left as it is, with a
    warning, and transformers' assisted loop runs it."""
    if assistant is model or getattr(assistant, _STATE_ATTR, None) is not None:
        return
    params = next(assistant.parameters(), None)
    runner = state.runner
    if params is None or params.device != runner.device:
        logger.warning(
            "attngraph: the assistant_model is on %s, the model on %s; it is not accelerated (move it to %s "
            "for attngraph's speculative loop)", None if params is None else params.device, runner.device,
            runner.device,
        )  # fmt: skip
        return
    cfg = state.config
    draft_cfg = cfg.replace(
        attention_backend=cfg.draft_attention_backend or cfg.attention_backend, prefill_attention_backend=None,
        decode_attention_backend=None, verify_attention_backend=None, draft_attention_backend=None,
        kv_cache_tokens=runner.pool.capacity_tokens(), kv_memory_fraction=None,
    )  # fmt: skip
    logger.info("attngraph: accelerating the assistant_model %s (%s attention)", type(assistant).__name__,
                draft_cfg.attention_backend)  # fmt: skip
    try:
        accelerate(assistant, draft_cfg)
    except AttnGraphError as exc:
        logger.warning("attngraph: the assistant_model could not be accelerated (%s); transformers' assisted "
                       "loop runs it as it is", exc)  # fmt: skip


def _own_assisted_loop(model: torch.nn.Module, assistant: torch.nn.Module, kwargs: dict) -> bool:
    """Whether attngraph's speculative loop may serve this call's assistant: an accelerated one
    of the same vocabulary, greedy decoding, no tokenizers (those ask for transformers'
    universal assisted generation, which translates between vocabularies)."""
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    if getattr(assistant, _STATE_ATTR, None) is None or assistant is model:
        return False
    if kwargs.get("tokenizer") is not None or kwargs.get("assistant_tokenizer") is not None:
        return False
    if kwargs.get("do_sample", getattr(gen_cfg, "do_sample", False)):
        return False
    rows = [m.get_output_embeddings().weight.shape[0] if m.get_output_embeddings() is not None else None
            for m in (model, assistant)]  # fmt: skip
    return rows[0] is not None and rows[0] == rows[1]


def _assisted(model: torch.nn.Module, kwargs: dict) -> bool:
    """Assisted generation asked for: an assistant model or prompt lookup."""
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(gen_cfg, "prompt_lookup_num_tokens", None))
    return kwargs.get("assistant_model") is not None or lookup is not None


def _without_cache_implementation(model: torch.nn.Module, kwargs: dict) -> dict:
    """Checkpoints may set ``generation_config.cache_implementation`` (Gemma's "hybrid"); the
    paged cache replaces it, and transformers refuses a cache object alongside it."""
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    if getattr(gen_cfg, "cache_implementation", None) is None:
        return kwargs
    gen_cfg = copy.deepcopy(gen_cfg)
    gen_cfg.cache_implementation = None
    return {**kwargs, "generation_config": gen_cfg}


def _forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = state_of(model)
    cache = kwargs.get(state.cache_kwarg)
    if not isinstance(cache, PagedCache):
        return state.original_forward(*args, **kwargs)
    if args:
        raise AttnGraphError("pass input_ids by keyword to an accelerated model's forward")
    if kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGenerationError("inputs_embeds are not supported by the paged runtime; pass input_ids")
    check_forward_kwargs(kwargs)
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise ValueError("input_ids is required")
    step = (kwargs.get("attention_mask"), kwargs.get("logits_to_keep", 0), kwargs.get("position_ids"))
    if kwargs.get("use_cache") is False:
        # HF re-feeds the whole sequence each step: run it on pages of its own, stored nowhere.
        scratch = PagedCache(state.runner)
        scratch.layout_checked = cache.layout_checked
        try:
            logits = scratch.step(input_ids, *step)
        finally:
            scratch.free()
    else:
        logits = cache.step(input_ids, *step)
    out = CausalLMOutputWithPast(logits=logits)
    out[state.cache_kwarg] = cache
    return out if kwargs.get("return_dict", True) is not False else out.to_tuple()

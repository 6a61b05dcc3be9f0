"""Registry of attention backends: a dict of lazy factories plus a decorator.

Factories import their heavy dependency (FlashInfer, Triton) only when called, so
``import attngraph`` works on a machine without them; a missing dependency surfaces as
`BackendUnavailableError` naming the install command and the alternatives.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch

from ..errors import BackendUnavailableError
from .base import AttentionBackend, ModelAttentionSpec

BackendFactory = Callable[[], type[AttentionBackend]]

_FACTORIES: dict[str, BackendFactory] = {}
#: Preference order of "auto" on CUDA; the first one that can serve the model wins. Triton
#: first: its extend attention is recorded inside whole-step CUDA graphs, which FlashInfer's
#: is not (H200, Llama-1B shape: 1 x 128 prefill 1.4 vs 3.7 ms, time to first token 6.8 vs
#: 12 ms, decode at batch 1 1.38 vs 1.59 ms, less memory beyond the KV pool). FlashInfer's
#: kernels are faster for long prefills at head dim 128 (1 x 4096: 0.30 vs 0.46 ms per layer):
#: name it, or a hybrid with ``prefill_attention_backend="flashinfer"``, for such loads.
_AUTO_ORDER_CUDA = ("triton", "flashinfer", "torch_native")
_AUTO_ORDER_CPU = ("torch_native",)


def register_attention_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: register ``factory`` (returning the backend class) under ``name``."""

    def deco(factory: BackendFactory) -> BackendFactory:
        if name in _FACTORIES:
            raise ValueError(f"attention backend {name!r} is already registered")
        _FACTORIES[name] = factory
        return factory

    return deco


def known_backend_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``; raises `BackendUnavailableError` if it cannot load."""
    if name not in _FACTORIES:
        raise BackendUnavailableError(
            f"unknown attention backend {name!r}; registered: {sorted(_FACTORIES)} (or 'auto')"
        )
    return _FACTORIES[name]()


def _why_not(name: str, spec: ModelAttentionSpec) -> str | None:
    try:
        cls = get_backend_class(name)
    except BackendUnavailableError as exc:
        return str(exc)
    return cls.capabilities.why_not(spec)


def resolve_backend_name(name: str, spec: ModelAttentionSpec) -> str:
    """Turn ``"auto"`` into a concrete backend name for ``spec``; check an explicit one.

    Raises `BackendUnavailableError` with the reason (and the alternatives that would work)
    when the named backend cannot serve the model.
    """
    if name == "auto":
        order = _AUTO_ORDER_CUDA if spec.device_type == "cuda" else _AUTO_ORDER_CPU
        reasons = []
        for cand in order:
            why = _why_not(cand, spec)
            if why is None:
                return cand
            reasons.append(f"{cand}: {why}")
        raise BackendUnavailableError("no attention backend can serve this model: " + "; ".join(reasons))
    why = _why_not(name, spec)
    if why is not None:
        alternatives = [n for n in _FACTORIES if n != name and _why_not(n, spec) is None]
        raise BackendUnavailableError(
            f"attention backend {name!r} cannot serve this model: {why}. "
            f"Backends that can: {alternatives or 'none'}"
        )
    return name


def available_device_types() -> tuple[str, ...]:
    """Device types this process can run on: always ``"cpu"``, ``"cuda"`` when a GPU is visible."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def check_usable_here(name: str) -> None:
    """Raise `BackendUnavailableError` now if backend ``name`` cannot run on this machine at all.

    Called when a backend is configured (``attngraph.backend(...)``), before any model is
    traced: its package must import and one of its device types must be present. Whether it
    serves a particular model (dtype, head dim, window) is checked once the model is traced.
    ``"auto"`` always passes (torch_native runs anywhere).
    """
    if name == "auto":
        return
    cls = get_backend_class(name)
    here = available_device_types()
    if not set(cls.capabilities.device_types) & set(here):
        usable = [n for n in _FACTORIES if n != name and _usable_on(n, here)]
        hint = f"; {cls.capabilities.device_hint}" if cls.capabilities.device_hint else ""
        raise BackendUnavailableError(
            f"attention backend {name!r} runs on {cls.capabilities.device_types}, and this machine has only "
            f"{here}{hint}. Backends that run here: {usable or 'none'} (or 'auto')."
        )


def _usable_on(name: str, device_types: tuple[str, ...]) -> bool:
    try:
        return bool(set(get_backend_class(name).capabilities.device_types) & set(device_types))
    except BackendUnavailableError:
        return False


def create_backend(name: str, spec: ModelAttentionSpec, **options: Any) -> AttentionBackend:
    """Instantiate backend ``name`` (or ``"auto"``) for ``spec``.

    ``options`` (e.g. ``deterministic=True``) go to the constructor of backends that accept
    them; a backend without such a parameter ignores the option.
    """
    cls = get_backend_class(resolve_backend_name(name, spec))
    accepted = inspect.signature(cls.__init__).parameters
    return cls(spec, **{k: v for k, v in options.items() if k in accepted})


def _lazy(module: str, attr: str, install_hint: str | None = None) -> BackendFactory:
    def factory() -> type[AttentionBackend]:
        try:
            mod = importlib.import_module(module, package=__package__)
        except ImportError as exc:
            hint = f" Install it with `{install_hint}`." if install_hint else ""
            raise BackendUnavailableError(
                f"attention backend from {module} is unavailable ({exc}).{hint} "
                "Alternatives: attention_backend='triton' (CUDA) or 'torch_native' (any device)."
            ) from exc
        return getattr(mod, attr)

    return factory


register_attention_backend("torch_native")(_lazy(".torch_native", "TorchNativeBackend"))
register_attention_backend("triton")(_lazy(".triton_backend", "TritonBackend", "pip install triton"))
register_attention_backend("flashinfer")(
    _lazy(".flashinfer_backend", "FlashInferBackend", "pip install 'attngraph[flashinfer]'")
)


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

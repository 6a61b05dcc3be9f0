"""attngraph: a torch.compile backend and paged-KV runtime for Hugging Face models."""

from importlib import metadata as _metadata

try:  # the version lives in pyproject.toml only; the installed metadata carries it
    __version__ = _metadata.version("attngraph")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

from .config import CompileConfig
from .errors import (
    AttnGraphError,
    BackendUnavailableError,
    CaptureError,
    ConfigError,
    InputError,
    KernelFaultError,
    KVCacheFullError,
    UnsupportedGenerationError,
    UnsupportedModelError,
)
from . import ops as _ops  # registers torch.ops.attngraph.attention
from .compiler import AttentionReport, explain
from .compiler import make_backend as backend
from .compiler import register as _register

from .runtime.accelerate import accelerate, restore

_register()

__all__ = [
    "__version__",
    "UnsupportedGenerationError",
    "accelerate",
    "restore",
    "AttentionReport",
    "backend",
    "explain",
    "AttnGraphError",
    "BackendUnavailableError",
    "CaptureError",
    "CompileConfig",
    "ConfigError",
    "InputError",
    "KernelFaultError",
    "KVCacheFullError",
    "UnsupportedModelError",
]

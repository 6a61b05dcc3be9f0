"""Exceptions raised by attngraph. Every message says what to do next."""

from __future__ import annotations


class AttnGraphError(Exception):
    """Base class of every error attngraph raises on purpose."""


class ConfigError(AttnGraphError, ValueError):
    """A `CompileConfig` field is unknown, out of range, or conflicts with another."""


class InputError(AttnGraphError, ValueError, TypeError):
    """An argument of a call is malformed: an empty batch, token ids of the wrong dtype or device.

    Also a `ValueError` and a `TypeError`, so code written against those still catches it.
    """


class UnsupportedModelError(AttnGraphError):
    """The model (or one of its attention sites) cannot be served; the message lists why."""


class UnsupportedGenerationError(AttnGraphError, ValueError):
    """A generate() option the accelerated path does not serve (beam search, assisted decoding...)."""


class BackendUnavailableError(AttnGraphError):
    """An attention backend cannot be used here (missing package, device, or capability)."""


class KVCacheFullError(AttnGraphError):
    """The paged KV pool has too few free pages; raised before anything is written."""


class KernelFaultError(AttnGraphError):
    """A kernel reported a fault during the call that just ended (a wait that gave up): that
    call's outputs may be wrong, and so may later ones of the same accelerated model."""


class CaptureError(AttnGraphError):
    """CUDA graph capture failed or a replay found its inputs moved."""

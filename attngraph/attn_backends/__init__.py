"""Attention backends: the contract (`base`), the registry, and the implementations."""

from .base import AttentionBackend, AttentionLayer, BackendCapabilities, GraphSupport, ModelAttentionSpec
from .registry import create_backend, get_backend_class, register_attention_backend, resolve_backend_name

__all__ = [
    "AttentionBackend",
    "AttentionLayer",
    "BackendCapabilities",
    "GraphSupport",
    "ModelAttentionSpec",
    "create_backend",
    "get_backend_class",
    "register_attention_backend",
    "resolve_backend_name",
]

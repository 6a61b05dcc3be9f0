"""FlashInferBackend's constructor options and their errors, on any machine.

The options are validated before FlashInfer is touched, so the module is imported here with a
stand-in ``flashinfer`` module when the real one is absent (both entries of ``sys.modules`` are
restored afterwards, so the registry still reports FlashInfer as unavailable elsewhere).
"""

import importlib
import importlib.util
import sys
import types

import pytest

MODULE = "attngraph.attn_backends.flashinfer_backend"


@pytest.fixture
def fi(monkeypatch):
    stub = importlib.util.find_spec("flashinfer") is None
    if stub:
        monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
        monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield importlib.import_module(MODULE)
    if stub:  # the module imported against the stand-in must not linger
        sys.modules.pop(MODULE, None)
        monkeypatch.delattr(sys.modules["attngraph.attn_backends"], "flashinfer_backend", raising=False)


def test_defaults(fi):
    b = fi.FlashInferBackend(None)
    assert b.decode_tensor_cores is None and b.extend_impl == "auto" and not b.deterministic
    assert b._split_kwargs(16) == {}


def test_tensor_core_rule_and_overrides(fi, monkeypatch):
    kind = lambda hq, hkv: fi._Kind(hq, hkv, 64, 64, 0.125, True, -1, 0.0)  # noqa: E731
    b = fi.FlashInferBackend(None)
    assert [b._tensor_cores(kind(h, 8)) for h in (8, 16, 24, 32, 64)] == [False, False, False, True, True]
    assert fi.FlashInferBackend(None, decode_tensor_cores=False)._tensor_cores(kind(64, 8)) is False
    assert fi.FlashInferBackend(None, decode_tensor_cores=True)._tensor_cores(kind(8, 8)) is True
    # the environment no longer overrides the rule: options come through CompileConfig only
    monkeypatch.setenv("ATTNGRAPH_FLASHINFER_DECODE_TC", "1")
    monkeypatch.setenv("ATTNGRAPH_FLASHINFER_EXTEND", "paged")
    b = fi.FlashInferBackend(None)
    assert b._tensor_cores(kind(8, 8)) is False and b.extend_impl == "auto"


def test_bad_options_raise_with_the_fix(fi):
    from attngraph.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_tensor_cores must be None .* got 'yes'"):
        fi.FlashInferBackend(None, decode_tensor_cores="yes")
    with pytest.raises(ConfigError, match="extend_impl must be one of"):
        fi.FlashInferBackend(None, extend_impl="ragged")
    with pytest.raises(ConfigError, match="deterministic=True needs the tensor-core decode"):
        fi.FlashInferBackend(None, deterministic=True, decode_tensor_cores=False)
    with pytest.raises(ConfigError, match="deterministic=True needs the paged prefill"):
        fi.FlashInferBackend(None, deterministic=True, extend_impl="ragged_merge")


def test_config_options_reach_the_backend(fi):
    """CompileConfig's flashinfer_* fields reach the constructor through create_attention_backend
    (and the Triton backend, which names neither, ignores them)."""
    import torch

    from attngraph.attn_backends.base import ModelAttentionSpec
    from attngraph.attn_backends.hybrid import HybridBackend, create_attention_backend
    from attngraph.config import CompileConfig

    spec = ModelAttentionSpec(2, 8, 2, (64,), torch.bfloat16, "cuda", 16)
    cfg = CompileConfig(attention_backend="flashinfer", flashinfer_decode_tensor_cores=False, flashinfer_extend="ragged_merge")
    b = create_attention_backend(cfg, spec=spec)
    assert type(b).__name__ == "FlashInferBackend" and b.decode_tensor_cores is False and b.extend_impl == "ragged_merge"
    b = create_attention_backend(cfg.replace(flashinfer_extend="paged", flashinfer_decode_tensor_cores=None), spec=spec)
    assert b.decode_tensor_cores is None and b.extend_impl == "paged"
    cfg = cfg.replace(flashinfer_extend="auto", flashinfer_decode_tensor_cores=None, deterministic=True)
    b = create_attention_backend(cfg, spec=spec)
    assert b.decode_tensor_cores is True and b.extend_impl == "paged"
    b = create_attention_backend(cfg.replace(decode_attention_backend="triton"), spec=spec)
    assert isinstance(b, HybridBackend)


def test_deterministic_fixes_the_split(fi):
    b = fi.FlashInferBackend(None, deterministic=True)
    assert b.decode_tensor_cores is True and b.extend_impl == "paged"  # fixed split: paged only
    assert b._split_kwargs(16) == {"fixed_split_size": fi.DETERMINISTIC_SPLIT_TOKENS // 16}
    assert b._split_kwargs(1) == {"fixed_split_size": fi.DETERMINISTIC_SPLIT_TOKENS}

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
    monkeypatch.delenv("ATTNGRAPH_FLASHINFER_DECODE_TC", raising=False)
    monkeypatch.delenv("ATTNGRAPH_FLASHINFER_EXTEND", raising=False)
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
    monkeypatch.setenv("ATTNGRAPH_FLASHINFER_DECODE_TC", "1")
    assert fi.FlashInferBackend(None)._tensor_cores(kind(8, 8)) is True
    monkeypatch.setenv("ATTNGRAPH_FLASHINFER_DECODE_TC", "0")
    assert fi.FlashInferBackend(None)._tensor_cores(kind(64, 8)) is False
    assert fi.FlashInferBackend(None, decode_tensor_cores=True).decode_tensor_cores is True  # argument wins


def test_bad_options_raise_with_the_fix(fi, monkeypatch):
    monkeypatch.setenv("ATTNGRAPH_FLASHINFER_DECODE_TC", "yes")
    with pytest.raises(ValueError, match="ATTNGRAPH_FLASHINFER_DECODE_TC='yes': use 1"):
        fi.FlashInferBackend(None)
    monkeypatch.delenv("ATTNGRAPH_FLASHINFER_DECODE_TC")
    with pytest.raises(ValueError, match="extend_impl must be one of"):
        fi.FlashInferBackend(None, extend_impl="ragged")
    with pytest.raises(ValueError, match="deterministic=True needs the tensor-core decode"):
        fi.FlashInferBackend(None, deterministic=True, decode_tensor_cores=False)


def test_deterministic_fixes_the_split(fi):
    b = fi.FlashInferBackend(None, deterministic=True, extend_impl="ragged_merge")
    assert b.decode_tensor_cores is True and b.extend_impl == "paged"  # fixed split: paged only
    assert b._split_kwargs(16) == {"fixed_split_size": fi.DETERMINISTIC_SPLIT_TOKENS // 16}
    assert b._split_kwargs(1) == {"fixed_split_size": fi.DETERMINISTIC_SPLIT_TOKENS}

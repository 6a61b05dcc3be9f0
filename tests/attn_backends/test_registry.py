import pytest
import torch

from attngraph import BackendUnavailableError
from attngraph.attn_backends import ModelAttentionSpec, create_backend, get_backend_class, resolve_backend_name
from attngraph.attn_backends.torch_native import TorchNativeBackend


def spec(**kw):
    base = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dims=(64,), dtype=torch.float32, device_type="cpu", page_size=16)
    return ModelAttentionSpec(**{**base, **kw})


def test_auto_on_cpu_is_torch_native():
    assert resolve_backend_name("auto", spec()) == "torch_native"
    assert isinstance(create_backend("auto", spec()), TorchNativeBackend)


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(BackendUnavailableError, match="torch_native"):
        get_backend_class("no_such_backend")


def test_explicit_backend_that_cannot_serve_fails_with_reason_and_alternatives():
    try:
        import flashinfer  # noqa: F401
        has_fi = True
    except ImportError:
        has_fi = False
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend_name("flashinfer", spec())
    msg = str(err.value)
    assert "torch_native" in msg  # names an alternative
    if not has_fi:
        assert "pip install" in msg

"""`compile_graph` hands inductor attngraph's CUDA options only for graphs on a CUDA device."""

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from attngraph.compiler import backend


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: torch.sin(x) + 1)


@pytest.mark.parametrize("device,expected", [("cpu", None), ("cuda", backend.CUDA_INDUCTOR_OPTIONS)])
def test_options_follow_the_inputs_device(monkeypatch, device, expected):
    import torch._inductor.compile_fx as cfx

    seen = {}

    def fake_compile_fx(gm, inputs, config_patches=None, **kwargs):
        seen["patches"] = config_patches
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    with FakeTensorMode():
        x = torch.empty(4, 8, device=device)
    backend.compile_graph(_graph(), [x], "inductor")
    assert seen["patches"] == expected
    if expected is not None:
        assert seen["patches"] is not backend.CUDA_INDUCTOR_OPTIONS  # a copy: inductor may not alter ours


def test_eager_pieces_are_not_compiled(monkeypatch):
    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", lambda *a, **k: pytest.fail("compiled"))
    gm = _graph()
    fn = backend.compile_graph(gm, [torch.randn(3)], "eager")
    x = torch.randn(5)
    assert torch.equal(fn(x), torch.sin(x) + 1)


def test_every_option_is_an_inductor_setting():
    import torch._inductor.config as inductor_config

    for name in backend.CUDA_INDUCTOR_OPTIONS:
        obj = inductor_config
        for part in name.split("."):
            obj = getattr(obj, part)  # raises on a name inductor does not have

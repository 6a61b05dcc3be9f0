"""`CompileConfig.inductor_options` reach inductor, and only attngraph's own compiles."""

import pytest
import torch
from torch import fx

import attngraph
from attngraph.compiler import backend
from attngraph.config import CUDA_INDUCTOR_OPTIONS, CompileConfig
from attngraph.errors import ConfigError


def _graph() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: torch.sin(x) + 1)


def test_defaults_per_device_and_overrides(monkeypatch):
    from attngraph import pdl

    cfg = CompileConfig()
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert cfg.resolved_inductor_options("cuda") == CUDA_INDUCTOR_OPTIONS
    assert cfg.resolved_inductor_options("cuda") is not CUDA_INDUCTOR_OPTIONS  # a copy
    monkeypatch.setattr(pdl, "ENABLED", True)
    has_pdl = hasattr(torch._inductor.config.triton, "enable_pdl")
    assert cfg.resolved_inductor_options("cuda") == {**CUDA_INDUCTOR_OPTIONS, **({"triton.enable_pdl": True} if has_pdl else {})}
    monkeypatch.setattr(pdl, "INDUCTOR", False)
    assert cfg.resolved_inductor_options("cuda") == CUDA_INDUCTOR_OPTIONS
    assert cfg.resolved_inductor_options("cpu") == {}
    off = CompileConfig(inductor_options={"combo_kernels": False, "triton.cudagraphs": False})
    assert off.resolved_inductor_options("cuda") == {"combo_kernels": False, "triton.cudagraphs": False}
    assert CompileConfig(inductor_options={}).resolved_inductor_options("cuda") == {}
    hash(off)  # configs stay hashable


@pytest.mark.parametrize(
    "bad", [{"combo_kernel": True}, {"triton.no_such_knob": 1}, ["combo_kernels"], 3, {"combo_kernels": "no"}]
)
def test_unknown_or_malformed_options_are_config_errors(bad):
    with pytest.raises(ConfigError, match="inductor_options"):
        CompileConfig(inductor_options=bad)


def test_compile_graph_hands_the_options_to_inductor(monkeypatch):
    import torch._inductor.compile_fx as cfx

    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, config_patches=None, **kw: seen.append(config_patches) or gm.forward)
    x = torch.randn(3)
    backend.compile_graph(_graph(), [x], "inductor", {"combo_kernels": True})
    backend.compile_graph(_graph(), [x], "inductor", {})
    backend.compile_graph(_graph(), [x], "inductor")
    assert seen == [{"combo_kernels": True}, None, None]


def test_eager_pieces_are_not_compiled(monkeypatch):
    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", lambda *a, **k: pytest.fail("compiled"))
    fn = backend.compile_graph(_graph(), [torch.randn(3)], "eager", {"combo_kernels": True})
    x = torch.randn(5)
    assert torch.equal(fn(x), torch.sin(x) + 1)


def test_torch_compile_backend_passes_the_options(monkeypatch):
    """The stateless backend on the CPU, forced through inductor: the user's options arrive."""
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        seen.append(config_patches)
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch._dynamo.reset()
    fn = torch.compile(
        lambda x: torch.softmax(x @ x.transpose(-1, -2), -1) @ x,
        backend=attngraph.backend(piece_compiler="inductor", inductor_options={"max_autotune": False}),
    )
    x = torch.randn(2, 5, 8)
    assert torch.allclose(fn(x), torch.softmax(x @ x.transpose(-1, -2), -1) @ x, atol=1e-5)
    assert seen[0] == {"max_autotune": False}  # (inductor then calls itself again inside the patch)

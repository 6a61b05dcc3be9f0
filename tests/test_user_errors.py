"""Every mistake a user can make comes out as an `AttnGraphError` subclass whose message says
what to do: a backend this machine cannot run, an empty batch, an attention implementation the
passes cannot read, an unknown config field."""

import copy

import pytest
import torch

import attngraph
from attngraph import BackendUnavailableError, ConfigError, InputError, UnsupportedModelError
from attngraph.runtime.accelerate import state_of

from .hf_models import build_model
from .passes.patterns import SdpaGqa

GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("make", [
    lambda: attngraph.CompileConfig(foo=1),
    lambda: attngraph.CompileConfig(page_size=4).replace(foo=1),
    lambda: attngraph.CompileConfig(*["auto"] * 40),
    lambda: attngraph.backend(foo=1),
])  # fmt: skip
def test_unknown_config_field_is_a_config_error(make):
    with pytest.raises(ConfigError, match="known fields|positional") as err:
        make()
    assert isinstance(err.value, attngraph.AttnGraphError)


# ----------------------------------------------------------------------------- backend choice
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_gpu_only_backend_is_refused_when_the_backend_is_built():
    """Before Dynamo sees it: attngraph's own error at ``attngraph.backend(...)``, not a
    BackendCompilerFailed at the first call."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        match = "pip install"  # the install command
    else:
        match = "torch_native"  # installed, but it runs on CUDA only: the alternatives
    with pytest.raises(BackendUnavailableError, match=match):
        attngraph.backend(attention_backend="flashinfer")
    with pytest.raises(BackendUnavailableError):
        attngraph.backend(decode_attention_backend="flashinfer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_refusal_at_compile_time_is_reachable_through_inner_exception():
    """What Dynamo must wrap (the string backend gets its options only when the first graph is
    compiled) keeps attngraph's error as ``.inner_exception``, as the README says."""
    torch.manual_seed(0)
    compiled = torch.compile(SdpaGqa().eval(), backend="attngraph", options={"attention_backend": "flashinfer"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as err:
        compiled(torch.randn(2, 5, 32))
    assert isinstance(err.value.inner_exception, BackendUnavailableError)


# ----------------------------------------------------------------------------- attention implementations
def test_flex_attention_is_refused_naming_the_ones_that_work():
    model = build_model("llama", "flex_attention")
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    with pytest.raises(UnsupportedModelError, match=r"attn_implementation='flex_attention'.*'sdpa', 'eager'"):
        attngraph.accelerate(model, attention_backend="torch_native")
    assert not hasattr(model, "_attngraph_state") or model._attngraph_state is None
    with pytest.raises(UnsupportedModelError, match="flex_attention.*sdpa"):
        attngraph.explain(model, ids)
    # The stateless form still serves it (attention left as it is) with the eager logits.
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(copy.deepcopy(model), backend="attngraph")(ids).logits,
                                   model(ids).logits)  # fmt: skip


# ----------------------------------------------------------------------------- empty batches
def test_empty_batch_stateless_gives_eager_result():
    torch.manual_seed(0)
    model = SdpaGqa().eval()
    x = torch.randn(0, 5, 32)
    want = model(x)
    got = torch.compile(model, backend="attngraph")(x)
    assert got.shape == want.shape == (0, 5, 32)
    # the same compiled graph still serves a real batch correctly afterwards
    y = torch.randn(2, 5, 32)
    torch.testing.assert_close(torch.compile(copy.deepcopy(model), backend="attngraph")(y), model(y))
    report = attngraph.explain(model, x)
    assert report.num_lowered == 1


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_empty_batch_generate_is_an_input_error(shape):
    model = attngraph.accelerate(build_model("llama", "sdpa"), attention_backend="torch_native", page_size=4,
                                 kv_cache_tokens=64)  # fmt: skip
    with pytest.raises(InputError, match="empty prompt.*at least one"):
        model.generate(torch.zeros(shape, dtype=torch.long), **GREEDY)
    pool = state_of(model).runner.pool
    assert pool.num_used_pages == 0 and pool.num_active_requests == 0
    ids = torch.randint(3, model.config.vocab_size, (1, 4))
    assert model.generate(ids, **GREEDY).shape == (1, 7)  # still usable

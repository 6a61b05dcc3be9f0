"""The piecewise runtime on the CPU: the graph split at attention (its pieces run without
graphs off CUDA) computes the same logits as the unsplit graph; graph modes off CUDA are
either ``none`` or a ConfigError.

The captured graphs themselves run only on CUDA: `test_piecewise_gpu.py`.
"""

import copy
import functools

import pytest
import torch
import transformers

import attngraph
from attngraph import CompileConfig
from attngraph.errors import ConfigError
from attngraph.forward_batch import ForwardBatch
from attngraph.runtime.model_runner import ModelRunner
from attngraph.runtime.piecewise import PiecewiseState, StaticPiece, build_piecewise
from attngraph.runtime.ragged_model import RaggedModel

from ..hf_models import build_model, tiny_config


def _split_runner(model, config: CompileConfig) -> tuple[ModelRunner, PiecewiseState]:
    """A CPU ModelRunner whose ragged model is compiled through the piecewise split."""
    runner = ModelRunner(model, config)
    state = PiecewiseState()
    runner.ragged = RaggedModel(model, config, compile_hook=functools.partial(build_piecewise, piece_compiler="eager", state=state))
    runner.ragged.backend.on_sites = runner._on_sites_checked
    return runner, state


def _steps(runner: ModelRunner, prompts: list[torch.Tensor], decode_tokens: torch.Tensor) -> list[torch.Tensor]:
    """A mixed prefill of ``prompts`` then one decode step; returns both steps' logits."""
    pool = runner.pool
    rows = [pool.alloc_request() for _ in prompts]
    lens = [len(p) for p in prompts]
    pool.reserve(rows, [n + 1 for n in lens])
    first = runner.forward(ForwardBatch.build(pool, rows, [0] * len(rows), lens, torch.cat(prompts)))
    second = runner.forward(ForwardBatch.build(pool, rows, lens, [1] * len(rows), decode_tokens))
    for r in rows:
        pool.free_request(r)
    return [first, second]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_split_ragged_model_gives_the_unsplit_logits(arch):
    impl = "eager" if arch == "gemma2" else "sdpa"
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=512, max_requests=4)
    g = torch.Generator().manual_seed(11)
    model = build_model(arch, impl, seed=5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (9, 3, 14)]
    decode = torch.randint(0, vocab, (3,), generator=g)

    plain = ModelRunner(model, config)
    want = _steps(plain, prompts, decode)
    runner, state = _split_runner(model, config)
    got = _steps(runner, prompts, decode)
    for a, b in zip(got, want):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert runner.num_compilations == 1
    n_layers = model.config.num_hidden_layers
    assert len(state.pieces) == n_layers + 1  # static pieces: before, between and after the attention ops
    assert all(isinstance(p, StaticPiece) and not p.entries for p in state.pieces)  # no graphs off CUDA


@pytest.mark.parametrize("mode", ["full", "piecewise", "full_and_piecewise", "breakable"])
def test_graph_modes_off_cuda_are_config_errors_naming_the_alternative(mode):
    model = build_model("llama", "sdpa", seed=2)
    with pytest.raises(ConfigError, match="needs a CUDA device.*cuda_graph='none'"):
        attngraph.accelerate(model, attention_backend="torch_native", cuda_graph=mode)
    assert "generate" not in vars(model) and "forward" not in vars(model)  # left as it was


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_none_and_auto_run_off_cuda(mode):
    model = build_model("llama", "sdpa", seed=3)
    attngraph.accelerate(model, attention_backend="torch_native", cuda_graph=mode, kv_cache_tokens=256)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_unknown_mode_and_bad_token_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="cuda_graph"):
        CompileConfig(cuda_graph="pieces")
    with pytest.raises(ConfigError, match="cuda_graph_num_tokens"):
        CompileConfig(cuda_graph_num_tokens=(8, 0))
    assert CompileConfig(cuda_graph_num_tokens=(64, 8, 8)).cuda_graph_num_tokens == (8, 64)


def test_the_fake_run_goes_through_each_shared_piece_once(monkeypatch):
    """Compiling walks the split module on fake inputs; a piece of the same structure as an
    earlier one (every decoder layer after the first) gets fresh outputs of the first one's
    sizes instead of running its ops again, and the split model still gives the unsplit
    logits."""
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = layers = 5
    torch.manual_seed(6)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2)
    executed = []
    real_call = torch.fx.Interpreter.call_module

    def counting(self, target, args, kwargs):
        executed.append(target)
        return real_call(self, target, args, kwargs)

    monkeypatch.setattr(torch.fx.Interpreter, "call_module", counting)
    runner, state = _split_runner(model, config)
    _ = runner.pool  # compiles
    monkeypatch.setattr(torch.fx.Interpreter, "call_module", real_call)
    (module,) = state.modules
    static = [n.target for n in module.graph.nodes if n.op == "call_module" and isinstance(getattr(module, n.target), StaticPiece)]
    assert len(static) == layers + 1
    ran_static = [t for t in executed if t in static]
    assert ran_static == [static[0], static[1], static[-1]]  # first, one middle, last
    reference = ModelRunner(copy.deepcopy(model), config)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 3)]
    decode = torch.randint(0, cfg.vocab_size, (2,), generator=g)
    for got, want in zip(_steps(runner, prompts, decode), _steps(reference, prompts, decode)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fresh_outputs_only_where_a_piece_returns_tensors_of_its_own():
    """`_fresh_like`: new tensors like the piece's own outputs (views of one storage stay views
    of one new storage, at their offsets), the same views of the next call's arguments where
    the piece passes an argument on, and no maker where that is not told by sizes alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attngraph.runtime.piecewise import _fresh_like

    with FakeTensorMode():
        x = torch.empty(4, 6)
        own = (torch.empty(4, 3), 7)
        make = _fresh_like(own, [x])
        new = make([torch.empty(4, 6)])
        assert new[1] == 7 and new[0].shape == (4, 3) and new[0].untyped_storage() is not own[0].untyped_storage()
        # views of an argument: the same views of the next call's argument
        other = torch.empty(8, 6)[2:6]  # another argument of x's sizes, 12 elements into its storage
        view, part = _fresh_like((x.view(6, 4), x[:, 2:]), [x])([other])
        assert view.untyped_storage() is part.untyped_storage() is other.untyped_storage()
        assert view.shape == (6, 4) and (view.storage_offset(), part.storage_offset()) == (12, 14)
        assert _fresh_like((x[:, 2:],), [x, x[1:]]) is None  # on a storage two arguments share
        assert _fresh_like((x,), [x[1:]]) is None  # starts before its argument
        # q / k / v: views of one fused output, at offsets 0, 8 and 10 of rows of 12
        qkv = torch.empty(5, 12)
        views = (qkv[:, :8], qkv[:, 8:10], qkv[:, 10:])
        a, b, c = _fresh_like(views, [x])([x])
        assert [t.storage_offset() for t in (a, b, c)] == [0, 8, 10] and a.stride() == b.stride() == (12, 1)
        assert a.untyped_storage() is b.untyped_storage() is c.untyped_storage()
        assert a.untyped_storage() is not qkv.untyped_storage() and a.untyped_storage().nbytes() == qkv.untyped_storage().nbytes()
        y = torch.empty(4, 2)
        twice = _fresh_like((y, y), [x])([x])
        assert twice[0].untyped_storage() is twice[1].untyped_storage() is not y.untyped_storage()
        # an argument passed on (the rotary embedding's cos / sin from layer to layer)
        cos, h = torch.empty(5, 4), torch.empty(5, 6)
        make = _fresh_like((h + 1, cos), [h, cos])
        other_cos = torch.empty(5, 4)
        got = make([torch.empty(5, 6), other_cos])
        assert got[1] is other_cos and got[0].shape == (5, 6)
        assert _fresh_like((qkv[:, :4], torch.empty(3).to(torch.int32)), [x]) is not None
        mixed = torch.empty(8, dtype=torch.int32)
        assert _fresh_like((mixed, mixed.view(torch.float32)), [x]) is None  # two dtypes on one storage


def test_layers_share_one_compiled_piece_and_attention_runs_without_the_dispatcher():
    from attngraph.runtime.piecewise import AttentionPiece

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = layers = 4  # three middle pieces, which must share one compiled function
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2)
    runner, state = _split_runner(model, config)
    _ = runner.pool  # compiles
    compiled = {id(p.compiled) for p in state.pieces}
    # first (embedding .. layer 0's q/k/v), middle (o_proj .. next q/k/v), last (o_proj .. norm)
    assert len(state.pieces) == layers + 1 and len(compiled) == 3
    assert all(p.capturable for p in state.pieces)  # sizes follow the token count alone
    # The split module calls AttentionPiece objects where the attention submodules were.
    (module,) = state.modules
    called = [getattr(module, n.target) for n in module.graph.nodes if n.op == "call_module"]
    assert sum(isinstance(c, AttentionPiece) for c in called) == layers
    assert sum(isinstance(c, StaticPiece) for c in called) == layers + 1


def test_padding_rows_never_reach_the_real_rows(one_thread):
    """A step padded to more rows (as a bucket pads it) gives the real rows' logits exactly."""
    model = build_model("qwen2", "sdpa", seed=6)
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=512, max_requests=4)
    runner, state = _split_runner(model, config)
    pool = runner.pool
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, model.config.vocab_size, (13,), generator=g)
    row = pool.alloc_request()
    pool.reserve([row], [13])
    batch = ForwardBatch.build(pool, [row], [0], [13], prompt)
    last = batch.qo_indptr[1:].long() - 1
    from attngraph.forward_context import ForwardContext, use_forward_context

    backend = runner.backend
    backend.init_forward_metadata(batch)
    with use_forward_context(ForwardContext(backend, batch)):
        want = runner.ragged(batch.input_ids, batch.positions, last)
        state.max_tokens = 32
        padded_ids = torch.cat([prompt, torch.randint(0, model.config.vocab_size, (19,), generator=g)])
        padded_pos = torch.cat([batch.positions, torch.arange(19)])
        with state.step(32):  # no graph captured for 32 on the CPU: the compiled pieces run, attention writes staging rows
            got = runner.ragged(padded_ids, padded_pos, last)
    pool.free_request(row)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_piece_sized_by_more_than_the_token_count_is_never_captured(monkeypatch):
    """Without the row split, the last piece also takes the logits rows (a second dynamic
    size): a graph captured per token bucket would replay stale row counts, so it runs compiled."""
    import attngraph.runtime.piecewise as piecewise

    monkeypatch.setattr(piecewise, "ROW_INDEX_INPUTS", ())
    model = build_model("llama", "sdpa", seed=7)
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2)
    runner, state = _split_runner(model, config)
    _ = runner.pool  # compiles
    assert [p.capturable for p in state.pieces] == [True] * model.config.num_hidden_layers + [False]


def test_capture_dummy_requests_stay_within_one_table_row():
    """A bucket larger than ``max_context_len`` is captured with several dummy requests on the
    padding row, each within its table row (the backends read a request's pages from it)."""
    from attngraph.runtime.piecewise_runner import PiecewiseGraphRunner

    model = build_model("llama", "sdpa", seed=9)
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2, max_context_len=16)
    runner = ModelRunner(model, config)
    pieces = PiecewiseGraphRunner(runner, PiecewiseState(), (8, 40))
    batch = pieces._dummy_batch(40)
    assert batch.seq_lens_cpu.tolist() == [16, 16, 8] and batch.num_tokens == 40
    assert set(batch.req_pool_indices.tolist()) == {runner.pool.pad_row}
    logits = runner.forward(batch)  # the reference backend indexes the table: no row overrun
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()
    assert runner.pool.num_used_pages == 0


def test_exact_token_counts_run_pieces_compiled_for_that_size(monkeypatch):
    """With inductor pieces and ``exact_token_counts=(2,)``, a decode step of one request (two
    token rows after padding) runs pieces compiled for exactly two tokens, the skinny products
    as reductions; its logits match the pieces compiled for any count. CUDA is where the
    runtime uses them; the CPU stands in here."""
    from attngraph.compiler import specialize
    from attngraph.runtime import piecewise

    exact_calls = []

    class OnCpu(specialize.TokenCountSpecialized):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "devices": ("cpu",)})
            compile_exact = self.compile_exact

            def counted(gm, fakes):
                fn = compile_exact(gm, fakes)
                return lambda *a: exact_calls.append(len(a)) or fn(*a)

            self.compile_exact = counted

    monkeypatch.setattr(piecewise, "TokenCountSpecialized", OnCpu)
    config = CompileConfig(attention_backend="torch_native", page_size=4, kv_cache_tokens=256, max_requests=2)
    model = build_model("llama", "sdpa", seed=8)
    runner = ModelRunner(model, config)
    state = PiecewiseState()
    hook = functools.partial(
        build_piecewise, piece_compiler="inductor", state=state, exact_token_counts=(2,),
        exact_inductor_options=config.resolved_exact_inductor_options("cuda"),
    )
    runner.ragged = RaggedModel(model, config, compile_hook=hook)
    runner.ragged.backend.on_sites = runner._on_sites_checked
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=g)
    pool = runner.pool
    row = pool.alloc_request()
    pool.reserve([row], [7])
    exact_calls.clear()  # the compile's own dummy step has two tokens too
    prefill = runner.forward(ForwardBatch.build(pool, [row], [0], [6], ids[:6]))
    assert not exact_calls  # six tokens: the pieces compiled for any count
    decode = runner.forward(ForwardBatch.build(pool, [row], [6], [1], ids[6:]))
    assert all(isinstance(p.compiled, OnCpu) and len(p.compiled.exact) == 1 for p in state.pieces)
    assert len(exact_calls) == len(state.pieces)
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(prefill[0], want[5], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode[0], want[6], rtol=1e-4, atol=1e-4)


def test_exact_token_counts_where_they_cannot_apply_are_reported(caplog):
    """On the CPU (no graph split, eager pieces) the setting does nothing: the log says so
    and names what it needs."""
    model = build_model("llama", "sdpa", seed=2)
    with caplog.at_level("WARNING", logger="attngraph.runtime.model_runner"):
        ModelRunner(model, CompileConfig(attention_backend="torch_native", exact_token_counts=(2,)))
    assert "exact_token_counts=(2,) has no effect here" in caplog.text and "full_and_piecewise" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="attngraph.runtime.model_runner"):
        ModelRunner(model, CompileConfig(attention_backend="torch_native"))
    assert "exact_token_counts" not in caplog.text

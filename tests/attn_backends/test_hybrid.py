"""`HybridBackend` routes metadata and compute by mode; `create_attention_backend` picks one or two."""

import math
import os

import torch

if not torch.cuda.is_available():
    # `import attngraph` imports triton (through torch._inductor); Triton reads this variable on
    # import, and the Triton-kernel tests collected after this module need the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attngraph.attn_backends.base import (  # noqa: E402
    AttentionLayer,
    BackendCapabilities,
    GraphSupport,
    ModelAttentionSpec,
)
from attngraph.attn_backends.hybrid import HybridBackend, combine_capabilities, create_attention_backend  # noqa: E402
from attngraph.attn_backends.registry import known_backend_names, register_attention_backend  # noqa: E402
from attngraph.attn_backends.torch_native import TorchNativeBackend  # noqa: E402
from attngraph.config import CompileConfig  # noqa: E402
from attngraph.errors import BackendUnavailableError  # noqa: E402
from attngraph.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attngraph.runtime.kv_pool import KVPool  # noqa: E402

HQ, HKV, D, PAGE = 4, 2, 16, 4


class Recording(TorchNativeBackend):
    """torch_native that logs which of its entry points ran."""

    def __init__(self, spec=None, tag="x"):
        super().__init__(spec)
        self.tag = tag
        self.calls: list[str] = []

    def init_forward_metadata_out_graph(self, batch, in_capture=False):
        self.calls.append(f"out_graph:{batch.mode.value}")

    def init_forward_metadata_in_graph(self, batch):
        self.calls.append(f"in_graph:{batch.mode.value}")

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.calls.append("graph_state")

    def forward_decode(self, *args, **kwargs):
        self.calls.append("decode")
        return super().forward_decode(*args, **kwargs)

    def forward_extend(self, *args, **kwargs):
        self.calls.append("extend")
        return super().forward_extend(*args, **kwargs)

    def forward_dense(self, *args, **kwargs):
        self.calls.append("dense")
        return super().forward_dense(*args, **kwargs)


def make_pool():
    return KVPool(
        num_layers=1, num_kv_heads=HKV, head_dim=D, num_pages=32, page_size=PAGE,
        dtype=torch.float32, device="cpu", max_requests=4, max_context_len=64,
    )


def layer():
    return AttentionLayer(0, HQ, HKV, D, D, scale=1 / math.sqrt(D), window_left=5)


def qkv(gen, t):
    return (
        torch.randn(t, HQ, D, generator=gen),
        torch.randn(t, HKV, D, generator=gen),
        torch.randn(t, HKV, D, generator=gen),
    )


def run_steps(backend, gen_seed=0):
    """Prefill two requests (lengths 7 and 3), then two decode steps; outputs of each step."""
    gen = torch.Generator().manual_seed(gen_seed)
    pool = make_pool()
    rows = [pool.alloc_request(), pool.alloc_request()]
    lens = [7, 3]
    pool.reserve(rows, lens)
    batch = ForwardBatch.build(pool, rows, [0, 0], lens, torch.zeros(10, dtype=torch.long))
    assert batch.mode is ForwardMode.EXTEND
    backend.init_forward_metadata(batch)
    outs = [backend.forward(*qkv(gen, 10), layer(), batch)]
    for _ in range(2):
        pool.reserve(rows, [n + 1 for n in lens])
        batch = ForwardBatch.build(pool, rows, lens, [1, 1], torch.zeros(2, dtype=torch.long))
        assert batch.mode is ForwardMode.DECODE
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(*qkv(gen, 2), layer(), batch))
        lens = [n + 1 for n in lens]
    return outs


def test_routes_by_mode_and_matches_torch_native():
    prefill, decode = Recording(tag="p"), Recording(tag="d")
    hybrid = HybridBackend(prefill, decode)
    got = run_steps(hybrid)
    want = run_steps(TorchNativeBackend())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert prefill.calls == ["out_graph:extend", "in_graph:extend", "extend"]
    assert decode.calls == ["out_graph:decode", "in_graph:decode", "decode"] * 2


def test_mixed_and_idle_and_dense():
    prefill, decode = Recording(), Recording()
    hybrid = HybridBackend(prefill, decode)
    pool = make_pool()
    row = pool.alloc_request()
    pool.reserve([row], [5])
    mixed = ForwardBatch.build(pool, [row], [3], [2], torch.zeros(2, dtype=torch.long), mode=ForwardMode.MIXED)
    hybrid.init_forward_metadata_out_graph(mixed, in_capture=False)
    hybrid.init_forward_metadata_in_graph(mixed)
    gen = torch.Generator().manual_seed(1)
    hybrid.forward(*qkv(gen, 2), layer(), mixed)
    assert prefill.calls == ["out_graph:mixed", "in_graph:mixed", "extend"] and decode.calls == []

    idle = ForwardBatch.build(pool, [], [], [], torch.zeros(0, dtype=torch.long))
    assert idle.mode is ForwardMode.IDLE
    hybrid.init_forward_metadata(idle)
    out = hybrid.forward(*qkv(gen, 0), layer(), idle)
    assert out.shape == (0, HQ, D)
    assert len(prefill.calls) == 3 and decode.calls == []

    q, k, v = qkv(gen, 2 * 6)
    dense = hybrid.forward_dense(q, k, v, layer(), 2)
    torch.testing.assert_close(dense, TorchNativeBackend().forward_dense(q, k, v, layer(), 2))
    assert prefill.calls[-1] == "dense" and decode.calls == []

    hybrid.init_cuda_graph_state(8, 8)  # decode child only: torch_native extend is not FULL
    assert decode.calls == ["graph_state"] and "graph_state" not in prefill.calls


def test_capabilities_intersection():
    a = BackendCapabilities(
        device_types=("cuda", "cpu"), dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=None, page_sizes=(1, 16), logit_cap=False,
        graph_support={"decode": GraphSupport.NEVER, "extend": GraphSupport.PIECEWISE},
    )
    b = BackendCapabilities(
        device_types=("cuda",), dtypes=(torch.bfloat16, torch.float16), head_dims=(64, 128), value_in_key=False,
        graph_support={"decode": GraphSupport.FULL, "extend": GraphSupport.NEVER},
    )
    c = combine_capabilities(prefill=a, decode=b)
    assert not c.value_in_key  # MLA's latent pool needs both
    assert c.device_types == ("cuda",)
    assert c.dtypes == (torch.float16, torch.bfloat16)
    assert c.head_dims == (64, 128) and c.page_sizes == (1, 16)
    assert not c.logit_cap and c.sliding_window
    assert c.graph_support == {"decode": GraphSupport.FULL, "extend": GraphSupport.PIECEWISE}
    hybrid = HybridBackend(Recording(), Recording())
    assert hybrid.capabilities == combine_capabilities(
        TorchNativeBackend.capabilities, TorchNativeBackend.capabilities
    )


SPEC = ModelAttentionSpec(
    num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dims=(D,), dtype=torch.float32,
    device_type="cpu", page_size=PAGE,
)
_TEST_NAME = "test_hybrid_recording"
if _TEST_NAME not in known_backend_names():
    register_attention_backend(_TEST_NAME)(lambda: Recording)


def test_create_attention_backend():
    single = create_attention_backend("torch_native", spec=SPEC)
    assert type(single) is TorchNativeBackend
    # "auto" on CPU resolves to torch_native: same as the explicit decode name -> one backend.
    assert type(create_attention_backend("auto", decode_attention_backend="torch_native", spec=SPEC)) is TorchNativeBackend

    hybrid = create_attention_backend("torch_native", decode_attention_backend=_TEST_NAME, spec=SPEC)
    assert isinstance(hybrid, HybridBackend)
    assert type(hybrid.prefill_backend) is TorchNativeBackend and type(hybrid.decode_backend) is Recording
    assert hybrid.spec is SPEC

    from_cfg = create_attention_backend(CompileConfig(prefill_attention_backend=_TEST_NAME), spec=SPEC)
    assert type(from_cfg.prefill_backend) is Recording and type(from_cfg.decode_backend) is TorchNativeBackend
    with pytest.raises(TypeError, match="a backend name or a CompileConfig"):
        create_attention_backend(object(), spec=SPEC)
    with pytest.raises(TypeError, match="not both"):
        create_attention_backend(CompileConfig(), decode_attention_backend="torch_native", spec=SPEC)

    with pytest.raises(BackendUnavailableError):
        create_attention_backend("torch_native", prefill_attention_backend="flashinfer", spec=SPEC)

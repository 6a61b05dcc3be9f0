"""`decode_attention_o_fwd`: one request's decode attention and the output projection in one
launch, against `decode_attention_fwd` (the attention output, bit for bit) followed by the
projection in fp64 over the same rounded attention output.

Without CUDA the kernel runs in Triton's CPU interpreter, which runs its programs one after
another in ticket order: every attention program before every projection program (the
projection programs' wait for the merged groups then returns at once). On the GPU the ``gpu``
test replays the launch from a CUDA graph many times: the counters come back to zero, and the
results stay the same while the programs race.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attngraph.attn_backends.triton_backend import TritonBackend  # noqa: E402
from attngraph.attn_backends.triton_ops import decode_attention as da  # noqa: E402
from attngraph.attn_backends.triton_ops.decode_attention_o import decode_attention_o_fwd, new_sync  # noqa: E402
from attngraph.errors import InputError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


@pytest.fixture(autouse=True)
def _runnable():
    if DEVICE == "cpu" and (not da.interpreting() or da.interpreter_problem()):
        pytest.skip("needs CUDA or Triton's interpreter")


def make(seed: int, context: int, hq: int = 4, hkv: int = 2, d: int = 16, n: int = 24, bias: bool = True):
    """One request over ``context`` cached keys (random pool, pages in shuffled order), its
    new token's q, K, V (views of one fused projection row) and an output projection
    ``[n, hq * d]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bf16 = dict(dtype=torch.bfloat16)
    pages = -(-(context + 1) // PAGE) + 1
    k_pool = torch.randn(pages * PAGE, hkv, d, generator=gen, **bf16)
    v_pool = torch.randn(pages * PAGE, hkv, d, generator=gen, **bf16)
    order = torch.randperm(pages, generator=gen)[: pages - 1].to(torch.int32)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=gen, **bf16)
    w = (torch.randn(n, hq * d, generator=gen) * (hq * d) ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    step = dict(
        q=qkv[:, : hq * d].view(1, hq, d), k_new=qkv[:, hq * d : (hq + hkv) * d].view(1, hkv, d),
        v_new=qkv[:, (hq + hkv) * d :].view(1, hkv, d), k_pool=k_pool, v_pool=v_pool, req_to_page=order[None],
        rows=torch.zeros(1, dtype=torch.int32), seq_lens=torch.full((1,), context + 1, dtype=torch.int32),
        new_loc=(order[context // PAGE].long() * PAGE + context % PAGE).view(1), w=w, b=b,
    )  # fmt: skip
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in step.items()}


def splits_for(hkv: int) -> int:
    return TritonBackend().decode_max_splits(1, hkv, torch.device(DEVICE))


def attention_first(s: dict, max_splits: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_attention_fwd` (new K/V stored, splits merged) on copies of the pools:
    ``(attention output [1, Hq, D], K pool after, V pool after)``."""
    k_pool, v_pool = s["k_pool"].clone(), s["v_pool"].clone()
    hq, d = s["q"].shape[1:]
    out = torch.full((1, hq, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    da.decode_attention_fwd(
        s["q"], k_pool, v_pool, out, s["req_to_page"], s["rows"], s["seq_lens"],
        torch.empty(1, hq, max_splits, d, device=DEVICE), torch.empty(1, hq, max_splits, device=DEVICE), page_size=PAGE,
        scale=d**-0.5, max_splits=max_splits, window_left=window, k_new=s["k_new"], v_new=s["v_new"],
        new_loc=s["new_loc"], counters=torch.zeros(hq, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    return out, k_pool, v_pool


def fused(s: dict, max_splits: int, window: int, sync: torch.Tensor, counters: torch.Tensor, **kw):
    hq, d = s["q"].shape[1:]
    return decode_attention_o_fwd(
        s["q"], s["k_pool"], s["v_pool"], s["req_to_page"], s["rows"], s["seq_lens"],
        torch.full((1, hq, max_splits, d), float("nan"), device=DEVICE),
        torch.full((1, hq, max_splits), float("nan"), device=DEVICE), page_size=PAGE, scale=d**-0.5,
        max_splits=max_splits, k_new=s["k_new"], v_new=s["v_new"], new_loc=s["new_loc"], counters=counters,
        weight=s["w"], bias=s["b"], sync=sync, window_left=window,
        out=torch.full((1, s["w"].shape[0]), float("nan"), dtype=torch.bfloat16, device=DEVICE),
        attn_out=torch.full((hq * d,), float("nan"), dtype=torch.bfloat16, device=DEVICE), **kw,
    )  # fmt: skip


@pytest.mark.parametrize("context,window", [(20, -1), (150, -1), (150, 40)])
@pytest.mark.parametrize("preload", [True, False])
def test_fused_equals_attention_then_projection(context, window, preload):
    """One split (21 keys) and three merged in the launch (151 keys; the interpreter's blocks
    are 16 keys, splits 64), a sliding window; the weight tile before or after the wait."""
    s = make(context + window, context)
    splits = splits_for(2)
    assert splits >= 3
    want_attn, want_k, want_v = attention_first(s, splits, window)
    sync, counters = new_sync(DEVICE), torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # twice: the launch leaves its counters ready for the next
        y, attn = fused(s, splits, window, sync, counters, preload_weight=preload, block_o=8)
        assert torch.equal(attn.view(want_attn.shape), want_attn)
        assert torch.equal(s["k_pool"], want_k) and torch.equal(s["v_pool"], want_v)
        ref = attn.double() @ s["w"].double().T + s["b"].double()  # [N]
        assert y.shape == (1, 24) and not y.isnan().any()
        assert torch.allclose(y[0].double(), ref, atol=1e-2, rtol=2**-7)
        assert not sync.any() and not counters.any()


def test_without_bias_and_blocks_past_the_weight():
    """24 weight rows in blocks of 16: the second block's last 8 rows lie past the weight."""
    s = make(7, 60, bias=False)
    splits = splits_for(2)
    want_attn, _, _ = attention_first(s, splits, -1)
    y, attn = fused(s, splits, -1, new_sync(DEVICE), torch.zeros(8, dtype=torch.int32, device=DEVICE), block_o=16)
    assert torch.equal(attn.view(want_attn.shape), want_attn)
    assert torch.allclose(y[0].double(), attn.double() @ s["w"].double().T, atol=1e-2, rtol=2**-7)


def test_a_wait_that_gives_up_is_counted_and_the_launch_still_ends():
    """A merged-group count that never reaches the KV heads (``sync[1]`` set far below zero, as
    a lost release would leave it): every projection program gives up its wait after
    ``MAX_SPINS`` polls and adds itself to ``sync[3]`` (24 rows in blocks of 8: 3 programs),
    which stays; the launch's other counters come back to zero, and the attention output is
    still right."""
    if DEVICE == "cuda":
        pytest.skip("polls 2**22 times on a GPU; the interpreter polls 100 times")
    s = make(11, 60)
    splits = splits_for(2)
    want_attn, _, _ = attention_first(s, splits, -1)
    sync = new_sync(DEVICE)
    sync[1] = -(1 << 20)
    _, attn = fused(s, splits, -1, sync, torch.zeros(8, dtype=torch.int32, device=DEVICE), block_o=8)
    assert torch.equal(attn.view(want_attn.shape), want_attn)
    assert sync.tolist() == [0, 0, 0, 3]


def test_refusals():
    s = make(3, 30)
    kw = dict(page_size=PAGE, scale=0.25, max_splits=4, k_new=s["k_new"], v_new=s["v_new"], new_loc=s["new_loc"],
              counters=torch.zeros(8, dtype=torch.int32, device=DEVICE), weight=s["w"], sync=new_sync(DEVICE))  # fmt: skip
    args = (s["k_pool"], s["v_pool"], s["req_to_page"], s["rows"], s["seq_lens"], torch.empty(1, 4, 4, 16, device=DEVICE),
            torch.empty(1, 4, 4, device=DEVICE))  # fmt: skip
    two = torch.cat([s["q"]] * 2)
    with pytest.raises(ValueError, match="one request"):
        decode_attention_o_fwd(two, *args, **kw)
    with pytest.raises(ValueError, match="weight must be"):
        decode_attention_o_fwd(s["q"], *args, **{**kw, "weight": s["w"][:, :32]})
    with pytest.raises(ValueError, match="block_o"):
        decode_attention_o_fwd(s["q"], *args, **kw, block_o=3)
    with pytest.raises(ValueError, match="counters"):
        decode_attention_o_fwd(s["q"], *args, **{**kw, "sync": torch.zeros(3, device=DEVICE)})
    with pytest.raises(InputError, match="N >= 1"):
        decode_attention_o_fwd(s["q"], *args, **{**kw, "weight": s["w"][:0]})
    with pytest.raises(InputError, match="weight must be on q's device"):
        decode_attention_o_fwd(s["q"], *args, **{**kw, "weight": s["w"].to("meta")})
    with pytest.raises(InputError, match="pools must be"):
        decode_attention_o_fwd(s["q"], s["k_pool"].half(), s["v_pool"].half(), *args[2:], **kw)
    wide = torch.zeros(1, 8, 1024, dtype=torch.bfloat16, device=DEVICE)  # Hq * D = 8192
    with pytest.raises(InputError, match="whole weight row"):
        decode_attention_o_fwd(wide, torch.zeros(32, 2, 1024, dtype=torch.bfloat16, device=DEVICE),
                               torch.zeros(32, 2, 1024, dtype=torch.bfloat16, device=DEVICE), *args[2:],
                               **{**kw, "weight": torch.zeros(4, 8192, dtype=torch.bfloat16, device=DEVICE),
                                  "k_new": torch.zeros(1, 2, 1024, dtype=torch.bfloat16, device=DEVICE),
                                  "v_new": torch.zeros(1, 2, 1024, dtype=torch.bfloat16, device=DEVICE)})  # fmt: skip
    assert not kw["sync"].any() and not kw["counters"].any()  # refused before any launch


@pytest.mark.gpu
@pytest.mark.parametrize("context", [40, 300])
def test_gpu_graph_replays_at_the_1b_shape(context):
    """The 1B shape (32 / 8 heads of 64, the output projection 2048 x 2048) captured in a CUDA
    graph and replayed 200 times: the attention output bit-equal to `decode_attention_fwd`'s,
    the projection within rounding, the same bits every replay, the counters zero after."""
    s = make(context, context, hq=32, hkv=8, d=64, n=2048)
    splits = splits_for(8)
    want_attn, _, _ = attention_first(s, splits, -1)
    sync, counters = new_sync(DEVICE), torch.zeros(32, dtype=torch.int32, device=DEVICE)
    y, attn = fused(s, splits, -1, sync, counters)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, attn = fused(s, splits, -1, sync, counters)
    graph.replay()
    torch.cuda.synchronize()
    first = y.clone()
    assert torch.equal(attn.view(want_attn.shape), want_attn)
    assert torch.allclose(y[0].double(), attn.double() @ s["w"].double().T + s["b"].double(), atol=2e-2, rtol=2**-7)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, first) and not sync.any() and not counters.any()


def test_compiles_for_hopper_without_spills():
    """The 1B configuration (groups of 4 heads of 64, 64-key blocks, a 2048-wide weight row in
    blocks of 4 rows, 4 warps) compiled for sm_90 by Triton's ptxas: it assembles, spills
    nothing and keeps its PDL wait; with the weight preloaded its loads precede the wait."""
    from ..sm90_compile import compile_in_child, ptxas_missing

    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    types = {**{p: "*bf16" for p in ("Q", "K", "V", "KNew", "VNew", "AttnOut", "W", "Bias", "Y")}, "PartO": "*fp32",
             "PartLse": "*fp32", "ReqToPage": "*i32", "ReqIdx": "*i32", "SeqLens": "*i32", "Counters": "*i32",
             "Sync": "*i32", "NewLoc": "*i64", "scale": "fp32"}  # fmt: skip
    const = dict(GROUP=4, HKV=8, PAGE_SIZE=16, HEAD_DIM=64, BLOCK_H=16, BLOCK_N=64, UPCAST=False, PRECISION="tf32",
                 USE_PDL=True, MERGE_CHUNK=4, KW=2048, BLOCK_O=4, HAS_BIAS=False, SOFT_BF16=False, MAX_SPINS=1 << 22)  # fmt: skip
    strides = ["stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_rtp", "stride_knh", "stride_vnh",
               "stride_wn", "N"]  # fmt: skip
    kernel = "attngraph.attn_backends.triton_ops.decode_attention_o:_decode_attention_o_kernel"
    early, late = compile_in_child([dict(kernel=kernel, types=types, constexprs={**const, "PRELOAD_W": pre},
                                         options=dict(num_warps=4, num_stages=2), divisible=strides)
                                    for pre in (True, False)])  # fmt: skip
    for got, preload in ((early, True), (late, False)):
        ptx = got["ptx"]
        assert got["local_bytes"] == 0, got["local_bytes"]
        waits = [i for i in range(len(ptx)) if ptx.startswith("griddepcontrol.wait", i)]
        assert len(waits) == 2  # one per role
        weight = ptx.find("ld.global.L1::evict_first")
        assert weight > 0 and (weight < waits[-1]) == preload, preload

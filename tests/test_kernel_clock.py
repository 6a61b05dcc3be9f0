"""`attngraph.kernel_clock`: timestamps recorded inside the decode attention kernel.

* CPU: the records decode (doctest); the decode kernel with ``TRACE`` compiled for sm_90 by
  Triton's ptxas (`tests/sm90_compile.py`): the timer reads assemble, the first stamp precedes
  ``griddepcontrol.wait`` and the next follows it, each later stamp is guarded by a predicate
  on the value it waits for, and nothing spills; without ``TRACE`` no timer is read.
* GPU: `decode_attention_fwd` and `skinny_linear` with a trace buffer give the bits they give
  without one, and every program leaves ordered stamps (decode: entry <= past the wait <=
  attended <= counted <= merged <= done, one merging program per tile).
"""

from __future__ import annotations

import doctest

import pytest
import torch

from attngraph import kernel_clock

from .sm90_compile import compile_in_child, ptxas_missing

DECODE = "attngraph.attn_backends.triton_ops.decode_attention:_decode_stage1_kernel"
TYPES = {**{p: "*bf16" for p in ("Q", "K", "V", "KNew", "VNew", "Out", "RopeCos", "RopeSin")}, "PartO": "*fp32",
         "PartLse": "*fp32", "Slopes": "*fp32", "Sinks": "*fp32", "ReqToPage": "*i32", "ReqIdx": "*i32",
         "SeqLens": "*i32", "Counters": "*i32", "NewLoc": "*i64", "Trace": "*i64", "L2Next": "*bf16", "scale": "fp32",
         "logit_cap": "fp32"}  # fmt: skip
#: the 1B decode configuration: heads of 64, 64-key blocks on 4 warps, K/V store, merge, PDL
CONFIG = dict(GROUP=4, PAGE_SIZE=16, HEAD_DIM=64, V_HEAD_DIM=64, BLOCK_H=16, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64,
              HAS_CAP=False, UPCAST=False, PRECISION="tf32", HAS_ALIBI=False, HEAD_BLOCKS=1, BLOCK_DT=16,
              HAS_TAIL=False, NEW_KV=True, MERGE=True, HAS_SINKS=False, USE_PDL=True, PREFETCH=True, ROPE=False,
              SOFT_BF16=False, MERGE_CHUNK=4, L2_LANES=0, L2_PIECE=16384)  # fmt: skip
STRIDES = ["stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_rtp", "stride_knb",
           "stride_vnb", "stride_ob", "stride_oh", "stride_rcb", "stride_rsb"]  # fmt: skip


def test_records_decode():
    failed, attempted = doctest.testmod(kernel_clock)
    assert attempted >= 1 and failed == 0
    b = kernel_clock.new_buffer(3, "cpu")
    assert b.shape == (3, kernel_clock.RECORD) and b.dtype == torch.int64 and not b.any()
    b[1, :3] = torch.tensor([10_000, 11_000, 0])  # a program that stopped after two points
    b[1, kernel_clock.POINTS : kernel_clock.POINTS + 2] = torch.tensor([7, 1907])
    b[2, :3] = torch.tensor([9_000, 12_500, 13_000])
    b[2, kernel_clock.POINTS : kernel_clock.POINTS + 3] = torch.tensor([50, 3550, 4050])
    recs = kernel_clock.decode(b, ("entry", "wait", "done"))
    assert [r["program"] for r in recs] == [1, 2]  # program 0 never ran
    assert recs[0]["wait_us"] == 2.0 and recs[0]["done_us"] is None and recs[0]["wait_cycles"] == 1900
    assert recs[1]["entry_us"] == 0.0 and recs[1]["done_us"] == 4.0 and recs[1]["done_cycles"] == 4000
    assert kernel_clock.decode(kernel_clock.new_buffer(2, "cpu"), ("entry",)) == []
    from attngraph.errors import InputError

    for bad, names in ((torch.zeros(2, 5, dtype=torch.int64), ("entry",)), (b.int(), ("entry",)), (b, ())):
        with pytest.raises(InputError, match="new_buffer"):
            kernel_clock.decode(bad, names)


def _check_stamps(traced: dict, plain: dict, stamps: int) -> None:
    ptx = traced["ptx"]
    reads = [i for i in range(len(ptx)) if ptx.startswith("%globaltimer", i)]
    wait = ptx.find("griddepcontrol.wait")
    assert len(reads) >= stamps and wait > 0
    assert reads[0] < wait < reads[1], "the entry stamp precedes the PDL wait, the next one follows it"
    assert ptx.count("%clock64") == len(reads) and "%smid" in ptx
    assert ptx.count("setp.eq.b32") >= 2 * len(reads)  # every read guarded by its dependency
    assert "%globaltimer" not in plain["ptx"] and "%clock64" not in plain["ptx"]
    assert traced["local_bytes"] == 0 and plain["local_bytes"] == 0


def test_traced_kernels_compile_for_hopper():
    """The decode kernel (six stamps) and the GEMV (four; the weight loaded before and after
    the wait) at the 1B shapes."""
    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    from .test_weight_prefetch import CASES, DIVISIBLE, GEMV, GEMV_TYPES

    gemv = {**GEMV, "STAGES": 1, "PREFETCH": False}
    specs = [dict(kernel=DECODE, types=TYPES, constexprs={**CONFIG, "TRACE": on}, options=dict(num_warps=4, num_stages=2),
                  divisible=STRIDES) for on in (True, False)]  # fmt: skip
    specs += [dict(kernel=CASES["gemv"][0], types={**GEMV_TYPES, "Trace": "*i64"}, constexprs={**gemv, "PRELOAD": pre, "TRACE": on},
                   options=dict(num_warps=4, num_stages=1), divisible=DIVISIBLE)
              for pre in (True, False) for on in (True, False)]  # fmt: skip
    got = compile_in_child(specs)
    _check_stamps(got[0], got[1], 6)
    _check_stamps(got[2], got[3], 4)
    _check_stamps(got[4], got[5], 4)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("context", [40, 200])
def test_trace_is_ordered_and_changes_nothing(context):
    """One request of the 1B shape (8 KV heads, 32 query heads of 64) over ``context`` cached
    keys (one split; four merged in the launch)."""
    from attngraph.attn_backends.triton_backend import TritonBackend
    from attngraph.attn_backends.triton_ops.decode_attention import decode_attention_fwd, decode_programs

    gen = torch.Generator(device="cuda").manual_seed(context)
    hq, hkv, d, page = 32, 8, 64, 16
    pages = -(-(context + 1) // page)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    k_pool, v_pool = (torch.randn(pages * page, hkv, d, generator=gen, **bf16) for _ in range(2))
    q = torch.randn(1, hq, d, generator=gen, **bf16)
    k_new, v_new = (torch.randn(1, hkv, d, generator=gen, **bf16) for _ in range(2))
    i32 = dict(device="cuda", dtype=torch.int32)
    req_to_page, req_idx = torch.arange(pages, **i32)[None], torch.zeros(1, **i32)
    seq_lens = torch.full((1,), context + 1, **i32)
    new_loc = torch.full((1,), context, device="cuda", dtype=torch.int64)
    splits = TritonBackend().decode_max_splits(1, hkv, q.device)
    programs = decode_programs(1, hq, hkv, d, d, q.dtype, splits)

    def run(trace):
        out = torch.full((1, hq, d), float("nan"), **bf16)
        part_o = torch.full((1, hq, splits, d), float("nan"), device="cuda")
        part_lse = torch.full((1, hq, splits), float("nan"), device="cuda")
        decode_attention_fwd(q, k_pool, v_pool, out, req_to_page, req_idx, seq_lens, part_o, part_lse, page_size=page,
                             scale=d**-0.5, max_splits=splits, k_new=k_new, v_new=v_new, new_loc=new_loc,
                             counters=torch.zeros(hq, **i32), trace=trace)  # fmt: skip
        return out

    want = run(None)
    trace = kernel_clock.new_buffer(programs, "cuda")
    assert torch.equal(run(trace), want)
    names = ("entry", "wait", "attended", "counted", "merged", "done")
    recs = kernel_clock.decode(trace, names)
    used = -(-(context + 1) // 64)
    assert len(recs) == programs  # every program records, those past the last split too
    attended = [r for r in recs if r["attended_us"] is not None]
    assert len(attended) == hkv * used
    assert sum(r["merged_us"] is not None for r in recs) == hkv  # one merging program per KV head
    for r in recs:
        times = [r[f"{n}_us"] for n in names if r[f"{n}_us"] is not None]
        assert times == sorted(times) and r["done_us"] is not None, r
        cycles = [r[f"{n}_cycles"] for n in names if r[f"{n}_cycles"] is not None]
        assert cycles == sorted(cycles), r
    assert all((r["counted_us"] is None) == (used == 1) for r in attended)


@pytest.mark.gpu
@pytest.mark.parametrize("preload", [1, 0])
def test_gemv_trace_is_ordered_and_changes_nothing(preload):
    from attngraph import skinny_linear as sl

    gen = torch.Generator(device="cuda").manual_seed(preload)
    x = torch.randn(1, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) * 2048**-0.5
    cfg = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, SPLIT_K=1, PRELOAD=preload)
    want = sl.skinny_linear(x, w, config=cfg)
    trace = kernel_clock.new_buffer(2048 // 4, "cuda")
    assert torch.equal(sl.skinny_linear(x, w, config=cfg, trace=trace), want)
    names = ("entry", "wait", "reduced", "unused3", "unused4", "done")
    recs = kernel_clock.decode(trace, names)
    assert len(recs) == 512
    for r in recs:
        times = [r[f"{n}_us"] for n in ("entry", "wait", "reduced", "done")]
        assert None not in times and times == sorted(times), r
    with pytest.raises(sl.InputError, match="trace must be"):
        sl.skinny_linear(x, w, config=cfg, trace=kernel_clock.new_buffer(100, "cuda"))

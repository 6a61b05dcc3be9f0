"""Decode attention asking L2 for the next projection's weight (``decode_attention_fwd(l2_next=...)``).

* CPU: which pieces the launch asks for (`l2_next_pieces`, `l2_lanes`): none without a range, on
  another device or below one piece; every piece covered by one lane.
* CPU: the 1B decode configuration compiled for sm_90 by Triton's ptxas (`tests/sm90_compile.py`):
  with lanes, predicated ``cp.async.bulk.prefetch.L2`` instructions after ``griddepcontrol.wait``
  and none before it, nothing spilled; without lanes, none at all.
* GPU: outputs and the pool bit-equal with and without the prefetch (poisoned outputs and
  partials), at one request and at 16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from .test_triton_decode_fused import DEVICE, make_decode_step, pool_copy, run  # noqa: E402, I001

from attngraph import weight_prefetch  # noqa: E402
from attngraph.attn_backends.triton_ops import decode_attention  # noqa: E402
from attngraph.attn_backends.triton_ops.decode_attention import l2_lanes, l2_next_pieces  # noqa: E402

PIECE = weight_prefetch.BULK_BYTES


def test_pieces_of_a_range():
    like = torch.zeros(4, dtype=torch.bfloat16)
    weight = torch.zeros(2048, 2048, dtype=torch.bfloat16)  # 8 MiB
    def none(found):
        return found[0] is like and found[1] == 0

    assert none(l2_next_pieces(None, like))
    t, pieces = l2_next_pieces((weight, weight.numel() * 2), like)
    assert t is weight and pieces == weight.numel() * 2 // PIECE == 512
    t, pieces = l2_next_pieces((weight, 3 * PIECE + 5), like)  # rounded down to whole pieces
    assert t is weight and pieces == 3
    assert none(l2_next_pieces((weight, PIECE - 16), like))
    assert none(l2_next_pieces((weight.view(-1)[1:], 10 * PIECE), like))  # not 16-byte aligned
    tail = weight.view(-1)[-PIECE:]  # 10 pieces asked from the last 32 KiB: clamped to the storage
    assert l2_next_pieces((tail, 10 * PIECE), like)[1] == 2
    if torch.cuda.is_available():
        assert none(l2_next_pieces((weight, 10 * PIECE), like.cuda()))  # another device


@pytest.mark.parametrize("pieces,programs,warps", [(512, 256, 4), (512, 640, 4), (2048, 8, 4), (1, 1, 8), (4096, 24, 4)])
def test_lanes_cover_every_piece(pieces, programs, warps):
    lanes = l2_lanes(pieces, programs, warps)
    assert lanes % (32 * warps) == 0 and lanes & (lanes - 1) == 0
    assert lanes * programs >= pieces and (lanes == 32 * warps or lanes // 2 * programs < pieces)
    assert l2_lanes(0, programs, warps) == 0


def test_compiled_for_hopper_the_prefetches_follow_the_wait():
    from ..sm90_compile import compile_in_child, ptxas_missing

    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    from ..test_kernel_clock import CONFIG, DECODE, STRIDES, TYPES

    base = {**CONFIG, "TRACE": False, "L2_PIECE": PIECE}
    with_lanes, without = compile_in_child([
        dict(kernel=DECODE, types=TYPES, constexprs={**base, "L2_LANES": 256}, options=dict(num_warps=4, num_stages=2),
             divisible=STRIDES),
        dict(kernel=DECODE, types=TYPES, constexprs={**base, "L2_LANES": 0}, options=dict(num_warps=4, num_stages=2),
             divisible=STRIDES),
    ])  # fmt: skip
    ptx = with_lanes["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first = ptx.find("cp.async.bulk.prefetch.L2.global")
    assert 0 < wait < first, "the prefetches must come after the wait (the q/k/v projection still streams before it)"
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 2  # 256 lanes on 128 threads: two per thread
    assert ptx.count("@p cp.async.bulk.prefetch.L2.global") == 2  # lanes past the last piece issue nothing
    assert "cp.async.bulk.prefetch" not in without["ptx"]
    assert with_lanes["local_bytes"] == 0 and without["local_bytes"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 16])
def test_gpu_outputs_bit_equal_with_the_prefetch(bsz):
    from attngraph import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("needs programmatic dependent launch (compute capability 9.0, a Triton with gdc_wait)")
    seq_lens = [129 + 37 * i for i in range(bsz)]
    step = make_decode_step(seq_lens, hq=32, hkv=8, d=64, dv=64, page_size=16, dtype=torch.bfloat16, seed=bsz)
    weight = torch.randn(2048, 2048, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(scale=0.125, max_splits=32, min_split_len=64)
    outs, pools = [], []
    for l2_next in (None, (weight, weight.numel() * 2), None, (weight, weight.numel() * 2)):
        k_buf, v_buf = pool_copy(step.k_buf, step.v_buf)  # the new token's slots poisoned
        counters = torch.zeros(bsz * 32, dtype=torch.int32, device=DEVICE)
        outs.append(run(step, k_buf, v_buf, new_kv=True, counters=counters, l2_next=l2_next, **kw))
        pools.append((k_buf, v_buf))
        torch.cuda.synchronize()
        assert not counters.any()
    assert not torch.isnan(outs[0]).any()
    for out, (k_buf, v_buf) in zip(outs[1:], pools[1:]):
        assert torch.equal(out, outs[0])
        assert torch.equal(k_buf, step.expected_k) and torch.equal(v_buf, step.expected_v)
    assert decode_attention.l2_next_pieces((weight, weight.numel() * 2), step.q)[1] == 512

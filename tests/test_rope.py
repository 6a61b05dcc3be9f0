"""HF's rotary embedding applied by attngraph (`attngraph.rope`, `attngraph.rope_kernel`), and
folded into the attention op and the Triton decode kernel.

References: HF's own ``apply_rotary_pos_emb`` (fp32: equal bits), the fp32 formula rounded
once (16-bit), and the same attention computed on tensors rotated first. Without CUDA the
kernels run in Triton's interpreter; outputs start NaN (`poison_empty`).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

pytest.importorskip("triton")

from attngraph import rope  # noqa: E402
from attngraph import rope_kernel  # noqa: E402
from attngraph.attn_backends.triton_ops.decode_attention import (  # noqa: E402
    decode_attention_fwd,
    interpreter_problem,
    interpreting,
)
from attngraph.errors import InputError  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_empty(poison_empty):
    """``torch.empty`` returns NaN-filled tensors for the duration of a test (conftest)."""


@pytest.fixture
def device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not interpreting():
        pytest.skip("needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1)")
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    return torch.device("cpu")


def rows(positions: torch.Tensor, d: int, dtype, device, base: float = 10000.0):
    """HF's default cos / sin rows ``[T, D]`` at ``positions``."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions.float()[:, None] * inv[None]] * 2, -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [T, H, D]`` through HF's ``apply_rotary_pos_emb`` (its ``[B, H, T, D]`` layout)."""
    xt = x.transpose(0, 1)[None]
    out, _ = apply_rotary_pos_emb(xt, xt, cos[None], sin[None])
    return out[0].transpose(0, 1)


def test_reference_is_hf_in_fp32_and_one_rounding_in_16_bits():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 64, generator=gen) * 3
    cos, sin = rows(torch.arange(6) * 7, 64, torch.float32, "cpu")
    assert torch.equal(rope.rope_reference(x, cos, sin), hf_rotate(x, cos, sin))
    xb, cb, sb = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    want = (xb.double() * cb.double()[:, None] + torch.cat((-xb[..., 32:], xb[..., :32]), -1).double() * sb.double()[:, None])
    got = rope.rope_reference(xb, cb, sb)
    assert (got.double() - want).abs().max().item() <= 2 ** -8 * want.abs().max().item()  # one bf16 rounding
    assert (got != hf_rotate(xb, cb, sb)).any()  # eager rounds each product and the sum


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hk", [(64, 8, 2), (80, 3, 1), (16, 4, 4)], ids=["d64", "d80", "d16"])
def test_kernel_equals_the_reference(device, dtype, d, hq, hk):
    """Strided q / k (views of a fused projection), a head dim no power of two, MQA."""
    gen = torch.Generator().manual_seed(d + hq)
    t = 5
    fused = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 2).to(dtype).to(device)
    q = fused[:, : hq * d].view(t, hq, d)
    k = fused[:, hq * d : (hq + hk) * d].view(t, hk, d)
    cos, sin = rows(torch.tensor([0, 3, 9, 100, 4000]), d, dtype, device)
    qo, ko = rope_kernel.rope_qk(q, k, cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    assert torch.equal(qo, rope.rope_reference(q, cos, sin)) and torch.equal(ko, rope.rope_reference(k, cos, sin))
    qa, ka = rope.apply_rope(q, k, cos, sin)  # the dispatching entry: the kernel on CUDA
    assert torch.equal(qa, qo) and torch.equal(ka, ko)


def test_refusals():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(InputError, match="cos must be"):
        rope.apply_rope(q, k, cos[:3], sin)
    with pytest.raises(InputError, match="sin must be"):
        rope.apply_rope(q, k, cos, sin.double())
    with pytest.raises(InputError, match="even"):
        rope.apply_rope(torch.randn(4, 2, 7), torch.randn(4, 1, 7), torch.randn(4, 7), torch.randn(4, 7))
    with pytest.raises(InputError, match="one T and D"):
        rope.apply_rope(q, k[:3], cos, sin)


# ----------------------------------------------------------------------------- the decode kernel
def _decode(q, kn, vn, kb, vb, lens, page, cos=None, sin=None):
    """One decode step over a fresh copy of the pool; returns (output, pool keys)."""
    b, hq, d = q.shape
    kb, vb = kb.clone(), vb.clone()
    pages_per_req = kb.shape[0] // page // b
    req_to_page = torch.arange(b * pages_per_req, dtype=torch.int32, device=q.device).view(b, pages_per_req)
    loc = torch.stack([req_to_page[i, (int(n) - 1) // page] * page + (int(n) - 1) % page for i, n in enumerate(lens)])
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    splits = 4
    part_o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    part_l = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    decode_attention_fwd(q, kb, vb, out, req_to_page, torch.arange(b, dtype=torch.int32, device=q.device),
                         lens.to(q.device), part_o, part_l, page_size=page, scale=d**-0.5, max_splits=splits,
                         min_split_len=8, k_new=kn, v_new=vn, new_loc=loc.to(torch.int64),
                         counters=torch.zeros(b * hq, dtype=torch.int32, device=q.device), rope_cos=cos, rope_sin=sin)  # fmt: skip
    return out, kb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_kernel_rotates_q_and_the_new_key(device, dtype):
    """Rotating q and k inside the kernel equals rotating them first, bit for bit: the output
    and the pool's new key (stored rotated)."""
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, d, page = 3, 8, 2, 64, 16
    lens = torch.tensor([5, 17, 40], dtype=torch.int32)
    kb = torch.randn(b * 4 * page, hkv, d, generator=gen).to(dtype).to(device)
    vb = torch.randn(b * 4 * page, hkv, d, generator=gen).to(dtype).to(device)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)  # a fused projection's rows
    q, kn, vn = qkv[:, : hq * d].view(b, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, d), qkv[:, (hq + hkv) * d :].view(b, hkv, d)
    cos, sin = rows(lens - 1, d, dtype, device)
    want, kb_want = _decode(rope.rope_reference(q, cos, sin), rope.rope_reference(kn, cos, sin), vn, kb, vb, lens, page)
    got, kb_got = _decode(q, kn, vn, kb, vb, lens, page, cos, sin)
    assert not got.isnan().any()
    assert torch.equal(got, want) and torch.equal(kb_got, kb_want)


def test_decode_kernel_refuses_rows_it_cannot_apply(device):
    q, kn = torch.randn(1, 2, 64, device=device), torch.randn(1, 1, 64, device=device)
    kb = torch.randn(16, 1, 64, device=device)
    cos, sin = rows(torch.tensor([3]), 64, torch.float32, device)
    with pytest.raises(ValueError, match="need each other"):
        _decode(q, kn, kn, kb, kb, torch.tensor([4], dtype=torch.int32), 16, cos, None)
    with pytest.raises(ValueError, match="rope_cos must be"):
        _decode(q, kn, kn, kb, kb, torch.tensor([4], dtype=torch.int32), 16, cos[:, :32], sin[:, :32])


# ----------------------------------------------------------------------------- the op
def test_op_with_rotary_rows_equals_the_op_on_rotated_tensors():
    """The stateless op (the torch_native reference): the rows are applied first; gradients
    reach q, k, cos and sin as through HF's rotation."""
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 6, 4, 2, 16
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = rows(torch.arange(t), d, torch.float32, "cpu")
    args = (0, d**-0.5, True, -1, 0.0, 1)
    want = torch.ops.attngraph.attention(hf_rotate(q, cos, sin), hf_rotate(k, cos, sin), v, *args)
    got = torch.ops.attngraph.attention(q, k, v, *args, None, 0, None, cos, sin)
    assert torch.equal(got, want)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, cos, sin)]
    torch.ops.attngraph.attention(leaves[0], leaves[1], v, *args, None, 0, None, leaves[2], leaves[3]).square().sum().backward()
    ref = [x.clone().requires_grad_(True) for x in (q, k, cos, sin)]
    torch.ops.attngraph.attention(hf_rotate(ref[0], ref[2], ref[3]), hf_rotate(ref[1], ref[2], ref[3]), v, *args).square().sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="come together"):
        torch.ops.attngraph.attention(q, k, v, *args, None, 0, None, cos, None)


# ----------------------------------------------------------------------------- compiled for sm_90
def test_kernels_compile_for_hopper_without_spills():
    """The decode kernel with the rotation (the 1B / 8B decode configuration: fused K/V store,
    merged splits, PDL with the pool prefetch) and the rotation kernel, compiled for sm_90 by
    Triton's ptxas: they assemble (the interpreter checks no types), spill nothing, and keep
    their PDL wait."""
    from .sm90_compile import compile_in_child, ptxas_missing

    if (why := ptxas_missing()) is not None:
        pytest.skip(why)
    bf16 = ("Q", "K", "V", "KNew", "VNew", "Out", "RopeCos", "RopeSin")
    types = {**{p: "*bf16" for p in bf16}, "PartO": "*fp32", "PartLse": "*fp32", "Slopes": "*fp32", "Sinks": "*fp32",
             "ReqToPage": "*i32", "ReqIdx": "*i32", "SeqLens": "*i32", "Counters": "*i32", "NewLoc": "*i64", "L2Next": "*bf16",
             "scale": "fp32", "logit_cap": "fp32"}  # fmt: skip
    decode = dict(GROUP=4, PAGE_SIZE=16, HEAD_DIM=64, V_HEAD_DIM=64, BLOCK_H=16, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64,
                  HAS_CAP=False, UPCAST=False, PRECISION="tf32", HAS_ALIBI=False, HEAD_BLOCKS=1, BLOCK_DT=16,
                  HAS_TAIL=False, NEW_KV=True, MERGE=True, HAS_SINKS=False, USE_PDL=True, PREFETCH=True, ROPE=True,
                  SOFT_BF16=False, MERGE_CHUNK=4, TRACE=False, L2_LANES=0, L2_PIECE=16384)  # fmt: skip
    strides = ["stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_rtp", "stride_knb",
               "stride_vnb", "stride_ob", "stride_oh", "stride_rcb", "stride_rsb"]  # fmt: skip
    rope_types = {**{p: "*bf16" for p in ("Q", "K", "Cos", "Sin", "QO", "KO")}}
    rope_const = dict(D=128, BLOCK_D=128, BLOCK_H=16, SOFT_BF16=False, USE_PDL=True)
    # heads of 64 in blocks of 256 keys on 8 warps (`decode_num_warps`; bench_generate --decode-block-n 256),
    # heads of 128 in the default 64 on 4 (the merge loading 4 splits at once), heads of 64 in the default 64
    dec, rot, dec8, dec64 = compile_in_child([
        dict(kernel="attngraph.attn_backends.triton_ops.decode_attention:_decode_stage1_kernel", types=types,
             constexprs={**decode, "BLOCK_N": 256}, options=dict(num_warps=8, num_stages=2), divisible=strides),
        dict(kernel="attngraph.rope_kernel:_rope_kernel", types=rope_types, constexprs=rope_const, options=dict(num_warps=4),
             divisible=["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ct", "stride_st"]),
        dict(kernel="attngraph.attn_backends.triton_ops.decode_attention:_decode_stage1_kernel", types=types,
             constexprs={**decode, "HEAD_DIM": 128, "V_HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_DV": 128, "MERGE_CHUNK": 4},
             options=dict(num_warps=4, num_stages=2), divisible=strides),
        dict(kernel="attngraph.attn_backends.triton_ops.decode_attention:_decode_stage1_kernel", types=types,
             constexprs=decode, options=dict(num_warps=4, num_stages=2), divisible=strides),
    ])  # fmt: skip
    for kernel in (dec, rot, dec8, dec64):
        assert kernel["local_bytes"] == 0, kernel["local_bytes"]
        assert "griddepcontrol.wait" in kernel["ptx"]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_kernel_on_the_gpu_at_llama_shapes():
    """The 8B decode and prefill shapes (32 / 8 heads of 128) and the 1B ones (32 / 8 of 64)."""
    for t, hq, hk, d in ((1, 32, 8, 128), (16, 32, 8, 64), (512, 32, 8, 128)):
        gen = torch.Generator().manual_seed(t)
        q = torch.randn(t, hq, d, generator=gen).bfloat16().cuda()
        k = torch.randn(t, hk, d, generator=gen).bfloat16().cuda()
        cos, sin = rows(torch.randint(0, 8000, (t,), generator=gen), d, torch.bfloat16, "cuda")
        qo, ko = rope.apply_rope(q, k, cos, sin)
        assert torch.equal(qo, rope.rope_reference(q, cos, sin)) and torch.equal(ko, rope.rope_reference(k, cos, sin))

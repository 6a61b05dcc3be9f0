"""`store_kv` (Triton; interpreter on CPU) against ``index_copy_`` into a poisoned pool."""

import os

import torch

if not torch.cuda.is_available():
    # The kernel module reads this when its @triton.jit runs, so set it before importing it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from attngraph.attn_backends.triton_ops.kv_store import store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused_projection(gen, t: int, hq: int, hkv: int, d: int, dv: int, dtype):
    """K and V as strided views of one ``[T, Hq*D + Hkv*D + Hkv*Dv]`` projection output."""
    qkv = torch.randn(t, hq * d + hkv * d + hkv * dv, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, hq * d : hq * d + hkv * d].view(t, hkv, d)
    v = qkv[:, hq * d + hkv * d :].view(t, hkv, dv)
    return k, v


@pytest.mark.parametrize(
    "hkv,d,dv,src_dtype,pool_dtype",
    [
        (2, 16, 16, torch.float32, torch.float32),
        (3, 24, 40, torch.float32, torch.float32),  # neither heads nor dims a power of two
        (1, 64, 64, torch.float32, torch.bfloat16),  # converted on store
        (4, 8, 16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_store_matches_index_copy(hkv, d, dv, src_dtype, pool_dtype):
    gen = torch.Generator().manual_seed(hkv * 100 + d + dv)
    slots, t = 97, 23
    k, v = fused_projection(gen, t, 4 * hkv, hkv, d, dv, src_dtype)
    assert not k.is_contiguous() and k.stride(2) == 1
    loc = torch.randperm(slots, generator=gen)[:t].to(DEVICE)  # distinct slots in random order
    poison_k = torch.randn(slots, hkv, d, generator=gen).to(pool_dtype).to(DEVICE)
    poison_v = torch.randn(slots, hkv, dv, generator=gen).to(pool_dtype).to(DEVICE)
    kb, vb = poison_k.clone(), poison_v.clone()
    store_kv(kb, vb, loc, k, v)
    want_k = poison_k.clone().index_copy_(0, loc, k.to(pool_dtype))
    want_v = poison_v.clone().index_copy_(0, loc, v.to(pool_dtype))
    assert torch.equal(kb, want_k) and torch.equal(vb, want_v)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(kb[untouched], poison_k[untouched])  # nothing outside loc written


def test_empty_step_writes_nothing_and_mismatches_are_refused():
    kb = torch.randn(8, 2, 16, device=DEVICE)
    vb = torch.randn(8, 2, 16, device=DEVICE)
    before = kb.clone()
    empty = torch.empty(0, 2, 16, device=DEVICE)
    store_kv(kb, vb, torch.empty(0, dtype=torch.long, device=DEVICE), empty, empty)
    assert torch.equal(kb, before)
    loc = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="3 K rows"):
        store_kv(kb, vb, loc, torch.randn(3, 2, 16, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="do not match"):
        store_kv(kb, vb, loc, torch.randn(2, 2, 8, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE))

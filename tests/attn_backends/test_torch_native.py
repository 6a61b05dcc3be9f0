"""The torch_native reference against a naive float64 formula written here (CPU, fp32).

The naive formula below is deliberately independent of `reference_attention` / `allowed_keys`:
explicit loops over queries and heads, an explicit key list, explicit softmax.
Mask conventions (AttentionLayer): causal: keys ``j <= p`` (and ``j >= p - window_left`` with a
window); non-causal: every key, or ``|j - p| <= window_left`` with a window (the convention of
triton_ops/extend_attention.py); GQA: query head ``h`` reads KV head ``h // group``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from attngraph.attn_backends.base import AttentionLayer
from attngraph.attn_backends.torch_native import TorchNativeBackend
from attngraph.forward_batch import ForwardBatch, ForwardMode
from attngraph.runtime.kv_pool import KVPool

ATOL = RTOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and stalls on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def naive_attention(q, k, v, q_pos, *, scale, causal, window_left, logit_cap):
    """``q: [Sq, Hq, D]`` at positions ``q_pos``, ``k: [Sk, Hkv, D]``, ``v: [Sk, Hkv, Dv]`` at
    positions ``0..Sk-1`` -> ``[Sq, Hq, Dv]`` float64."""
    q, k, v = q.double(), k.double(), v.double()
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    assert group * hkv == hq
    out = torch.zeros(sq, hq, dv, dtype=torch.float64)
    for i in range(sq):
        p = int(q_pos[i])
        keys = []
        for j in range(sk):
            if causal:
                ok = j <= p and (window_left < 0 or j >= p - window_left)
            else:
                ok = window_left < 0 or abs(j - p) <= window_left
            if ok:
                keys.append(j)
        assert keys, "every query must see at least one key in these tests"
        idx = torch.tensor(keys)
        for h in range(hq):
            kh = h // group
            s = (k[idx, kh] * q[i, h]).sum(-1) * scale  # [len(keys)]
            if logit_cap > 0:
                s = logit_cap * torch.tanh(s / logit_cap)
            e = torch.exp(s - s.max())
            w = e / e.sum()
            out[i, h] = (w[:, None] * v[idx, kh]).sum(0)
    return out


def make_layer(hq, hkv, d, dv, *, causal=True, window_left=-1, logit_cap=0.0, layer_id=0, scale=0.37):
    return AttentionLayer(layer_id=layer_id, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv,
                          scale=scale, causal=causal, window_left=window_left, logit_cap=logit_cap)


def naive_for(layer, q, k, v, q_pos):
    return naive_attention(q, k, v, q_pos, scale=layer.scale, causal=layer.causal,
                           window_left=layer.window_left, logit_cap=layer.logit_cap)


# (causal, window_left, logit_cap)
MASKS = {
    "causal": (True, -1, 0.0),
    "noncausal": (False, -1, 0.0),
    "window": (True, 3, 0.0),
    "window0": (True, 0, 0.0),  # a query sees only itself
    "noncausal_window": (False, 2, 0.0),
    "softcap": (True, -1, 4.0),
    "softcap_noncausal": (False, -1, 4.0),
    "softcap_window": (True, 2, 4.0),
}


# ---------------------------------------------------------------------------- dense


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 9), (1, 6)], ids=["sq=sk", "sq<sk", "sq=1"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("mask", list(MASKS))
def test_forward_dense(mask, group, sq, sk):
    causal, window, cap = MASKS[mask]
    torch.manual_seed(1000 * group + 10 * sq + sk + 7 * list(MASKS).index(mask))
    b, hkv, d, dv = 2, 2, 8, 6
    hq = hkv * group
    layer = make_layer(hq, hkv, d, dv, causal=causal, window_left=window, logit_cap=cap)
    # Scores of a few units: softcap (cap 4) and the softmax are far from linear.
    q = torch.randn(b * sq, hq, d) * 2
    k = torch.randn(b * sk, hkv, d) * 2
    v = torch.randn(b * sk, hkv, dv) * 3
    out = TorchNativeBackend().forward_dense(q, k, v, layer, b)
    assert out.shape == (b * sq, hq, dv) and out.dtype == torch.float32
    q_pos = list(range(sk - sq, sk))  # bottom-right alignment
    for i in range(b):
        want = naive_for(layer, q[i * sq:(i + 1) * sq], k[i * sk:(i + 1) * sk], v[i * sk:(i + 1) * sk], q_pos)
        torch.testing.assert_close(out[i * sq:(i + 1) * sq].double(), want, atol=ATOL, rtol=RTOL)


def test_dense_masks_actually_differ():
    """Guard against a vacuous naive formula: the mask variants give different answers."""
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 2, 8) * 2, torch.randn(6, 2, 8) * 2, torch.randn(6, 2, 8)
    outs = {name: naive_attention(q, k, v, range(6), scale=0.37, causal=c, window_left=w, logit_cap=cap)
            for name, (c, w, cap) in MASKS.items()}
    names = list(outs)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            assert not torch.allclose(outs[names[a]], outs[names[b]], atol=1e-3), (names[a], names[b])


# ---------------------------------------------------------------------------- paged


class PagedSetup:
    """A pool full of garbage, a few requests with scattered pages, their prefixes written."""

    def __init__(self, page_size, prefix_lens, extend_lens, *, hq, hkv, d, dv, seed, layer_id=1):
        torch.manual_seed(seed)
        rng = random.Random(seed)
        self.page_size = page_size
        self.prefix_lens, self.extend_lens = list(prefix_lens), list(extend_lens)
        self.seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_ctx = max(self.seq_lens) + 5
        n = len(prefix_lens)
        num_pages = sum(math.ceil(s / page_size) for s in self.seq_lens) + 2 * math.ceil(max_ctx / page_size) + 3
        self.pool = KVPool(num_layers=3, num_kv_heads=hkv, head_dim=d, num_pages=num_pages, page_size=page_size,
                           dtype=torch.float32, device="cpu", max_requests=n + 3, max_context_len=max_ctx,
                           v_head_dim=dv)
        pool = self.pool
        # Large finite garbage everywhere (dummy page included): a wrong page reads wrong numbers.
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.randn_like(buf) * 50)
        # Interleave the requests' pages with a decoy's, then free the decoy, so pages are scattered
        # and out of order.
        decoy = pool.alloc_request()
        self.rows = [pool.alloc_request() for _ in range(n)]
        rng.shuffle(self.rows)
        steps = 4
        for s in range(1, steps + 1):
            pool.reserve([decoy], [min(max_ctx, s * max_ctx // steps)])
            order = list(range(n))
            rng.shuffle(order)
            pool.reserve([self.rows[i] for i in order], [self.seq_lens[i] * s // steps for i in order])
        pool.free_request(decoy)

        # Full K/V of every request; write the cached prefixes at their slots.
        self.k_full = [torch.randn(s, hkv, d) * 2 for s in self.seq_lens]
        self.v_full = [torch.randn(s, hkv, dv) * 3 for s in self.seq_lens]
        self.q_new = [torch.randn(e, hq, d) * 2 for e in self.extend_lens]
        self.layer_id = layer_id
        for row, p, kf, vf in zip(self.rows, self.prefix_lens, self.k_full, self.v_full):
            slots = pool.slots_for(torch.tensor([row]), torch.tensor([0]), torch.tensor([p]))
            pool.write(layer_id, slots, kf[:p], vf[:p])

    def new_tokens(self):
        q = torch.cat(self.q_new)
        k = torch.cat([kf[p:] for kf, p in zip(self.k_full, self.prefix_lens)])
        v = torch.cat([vf[p:] for vf, p in zip(self.v_full, self.prefix_lens)])
        return q, k, v

    def batch(self, mode=None):
        t = sum(self.extend_lens)
        return ForwardBatch.build(self.pool, self.rows, self.prefix_lens, self.extend_lens,
                                  torch.zeros(t, dtype=torch.int64), mode=mode)

    def owned_slots(self, upto="seq"):
        """(page, offset) of every token of every request, from the host table."""
        out = []
        table = self.pool.req_to_page_cpu.tolist()
        for row, p, s in zip(self.rows, self.prefix_lens, self.seq_lens):
            end = s if upto == "seq" else p
            out.append([(table[row][pos // self.page_size], pos % self.page_size) for pos in range(end)])
        return out

    def check_outputs(self, out, layer):
        start = 0
        for kf, vf, qn, p, e in zip(self.k_full, self.v_full, self.q_new, self.prefix_lens, self.extend_lens):
            want = naive_for(layer, qn, kf, vf, list(range(p, p + e)))
            torch.testing.assert_close(out[start:start + e].double(), want, atol=ATOL, rtol=RTOL)
            start += e

    def check_pool_holds_full_kv(self):
        kb, vb = self.pool.k_buffers[self.layer_id], self.pool.v_buffers[self.layer_id]
        for slots, kf, vf in zip(self.owned_slots(), self.k_full, self.v_full):
            for pos, (page, off) in enumerate(slots):
                assert page != 0
                assert torch.equal(kb[page, off], kf[pos]), pos
                assert torch.equal(vb[page, off], vf[pos]), pos


def _random_lens(rng, n, page_size, decode):
    prefix, extend = [], []
    for i in range(n):
        if decode:
            # Prefixes ending just before / on / after a page boundary, and random ones.
            choices = [1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1, rng.randint(1, 40)]
            prefix.append(max(1, rng.choice(choices)))
            extend.append(1)
        else:
            prefix.append(0 if i % 3 == 0 else rng.randint(0, 37))
            extend.append(rng.randint(1, 13))
    return prefix, extend


PAGED_MASKS = ["causal", "window", "softcap_window", "noncausal", "noncausal_window", "softcap"]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("mask", PAGED_MASKS)
@pytest.mark.parametrize("mode", ["extend", "decode"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_forward(page_size, mode, mask, group):
    causal, window, cap = MASKS[mask]
    seed = 10_000 * page_size + 100 * PAGED_MASKS.index(mask) + 10 * group + (mode == "decode")
    rng = random.Random(seed)
    decode = mode == "decode"
    prefix, extend = _random_lens(rng, 5, page_size, decode)
    hkv, d, dv = 2, 8, 6
    hq = hkv * group
    s = PagedSetup(page_size, prefix, extend, hq=hq, hkv=hkv, d=d, dv=dv, seed=seed)
    layer = make_layer(hq, hkv, d, dv, causal=causal, window_left=window, logit_cap=cap, layer_id=s.layer_id)
    batch = s.batch()
    assert batch.mode is (ForwardMode.DECODE if decode else ForwardMode.EXTEND)

    # Snapshot the pool to check that only the new tokens' slots are written.
    pool = s.pool
    k_before = [b.clone() for b in pool.k_buffers]
    v_before = [b.clone() for b in pool.v_buffers]

    q, k, v = s.new_tokens()
    out = TorchNativeBackend().forward(q, k, v, layer, batch, save_kv_cache=True)
    assert out.shape == (sum(extend), hq, dv)
    s.check_outputs(out, layer)

    # The new K/V were written (and nothing else was).
    s.check_pool_holds_full_kv()
    new_slots = {ps for slots, p in zip(s.owned_slots(), prefix) for ps in slots[p:]}
    mask_other = torch.ones(pool.num_pages + 1, page_size, dtype=torch.bool)
    for page, off in new_slots:
        mask_other[page, off] = False
    kb, vb = pool.k_buffers[s.layer_id], pool.v_buffers[s.layer_id]
    assert torch.equal(kb[mask_other], k_before[s.layer_id][mask_other])
    assert torch.equal(vb[mask_other], v_before[s.layer_id][mask_other])
    for other in (0, 2):
        assert torch.equal(pool.k_buffers[other], k_before[other])
        assert torch.equal(pool.v_buffers[other], v_before[other])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_decode_and_extend_agree(page_size):
    """The same single-token batch run as DECODE and as EXTEND gives the same answer."""
    seed = 77 + page_size
    prefix, extend = _random_lens(random.Random(seed), 4, page_size, decode=True)
    s = PagedSetup(page_size, prefix, extend, hq=4, hkv=2, d=8, dv=6, seed=seed)
    layer = make_layer(4, 2, 8, 6, window_left=5, layer_id=s.layer_id)
    q, k, v = s.new_tokens()
    be = TorchNativeBackend()
    out_d = be.forward(q, k, v, layer, s.batch(), save_kv_cache=True)
    out_e = be.forward(q, k, v, layer, s.batch(mode=ForwardMode.EXTEND), save_kv_cache=True)
    torch.testing.assert_close(out_d, out_e, atol=ATOL, rtol=RTOL)
    s.check_outputs(out_d, layer)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_without_saving_reads_the_pool(page_size):
    """save_kv_cache=False: the new K/V already in the pool are used and the pool is not touched."""
    seed = 300 + page_size
    rng = random.Random(seed)
    prefix, extend = _random_lens(rng, 4, page_size, decode=False)
    s = PagedSetup(page_size, prefix, extend, hq=4, hkv=2, d=8, dv=6, seed=seed)
    layer = make_layer(4, 2, 8, 6, layer_id=s.layer_id)
    batch = s.batch()
    q, k, v = s.new_tokens()
    s.pool.write(s.layer_id, batch.out_cache_loc, k, v)
    snap = [b.clone() for b in s.pool.k_buffers + s.pool.v_buffers]
    out = TorchNativeBackend().forward(q, k, v, layer, batch, save_kv_cache=False)
    s.check_outputs(out, layer)
    for before, after in zip(snap, s.pool.k_buffers + s.pool.v_buffers):
        assert torch.equal(before, after)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_request_with_no_new_tokens(page_size):
    """A request adding 0 tokens (PagedCache's all-padding rows) is skipped; the others are right."""
    seed = 500 + page_size
    prefix, extend = [5, 9, 0, 17], [3, 0, 4, 1]
    s = PagedSetup(page_size, prefix, extend, hq=2, hkv=1, d=8, dv=8, seed=seed)
    layer = make_layer(2, 1, 8, 8, layer_id=s.layer_id)
    batch = s.batch()
    assert batch.mode is ForwardMode.EXTEND
    q, k, v = s.new_tokens()
    out = TorchNativeBackend().forward(q, k, v, layer, batch, save_kv_cache=True)
    assert out.shape == (8, 2, 8)
    s.check_outputs(out, layer)
    s.check_pool_holds_full_kv()


def test_idle_batch():
    pool = KVPool(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=4, page_size=4, dtype=torch.float32,
                  device="cpu", max_requests=2, max_context_len=16)
    batch = ForwardBatch.build(pool, [], [], [], torch.zeros(0, dtype=torch.int64))
    assert batch.mode is ForwardMode.IDLE
    layer = make_layer(4, 2, 8, 6)
    out = TorchNativeBackend().forward(torch.zeros(0, 4, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 6), layer, batch)
    assert out.shape == (0, 4, 6)


def test_forward_into_a_caller_buffer_and_a_wrong_buffer_is_refused_before_any_write():
    """``forward(out=)``: the result lands in the caller's (poisoned) buffer; a buffer of the
    wrong shape is an InputError raised before the K/V are written."""
    from attngraph.errors import InputError

    seed = 901
    prefix, extend = _random_lens(random.Random(seed), 3, 4, decode=False)
    s = PagedSetup(4, prefix, extend, hq=4, hkv=2, d=8, dv=6, seed=seed)
    layer = make_layer(4, 2, 8, 6, layer_id=s.layer_id)
    q, k, v = s.new_tokens()
    snap = [b.clone() for b in s.pool.k_buffers + s.pool.v_buffers]
    with pytest.raises(InputError, match="out= must be"):
        TorchNativeBackend().forward(q, k, v, layer, s.batch(), out=q.new_zeros(q.shape[0], 4, 8))
    assert all(torch.equal(a, b) for a, b in zip(snap, s.pool.k_buffers + s.pool.v_buffers))
    out = torch.full((q.shape[0], 4, 6), float("nan"), dtype=q.dtype)
    got = TorchNativeBackend().forward(q, k, v, layer, s.batch(), out=out)
    assert got is out and not out.isnan().any()
    s.check_outputs(out, layer)

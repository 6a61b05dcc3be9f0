"""Programmatic dependent launch (`attngraph.pdl`): where it applies, and on a Hopper GPU that
chains of PDL-launched kernels in a CUDA graph read their inputs only once written."""

from __future__ import annotations

import pytest
import torch

from attngraph import pdl


def test_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(torch.device("cuda", 0))
    assert pdl.inductor_options() == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not pdl.enabled(torch.device("cuda", 0))  # ROCm: no programmatic launch


def _hopper() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if not pdl.enabled(device):
        pytest.skip("needs compute capability >= 9.0 and a Triton with gdc_wait")
    return device


def _graph_of(fn):
    """``fn`` captured into a CUDA graph (after a warm-up on a side stream), and its output."""
    from .attn_backends.test_triton_backend import capture_step

    return capture_step(fn, fn)


@pytest.mark.gpu
def test_a_chain_of_pdl_gemvs_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    """Each GEMV reads the previous one's output (and a torch kernel's, launched without PDL, at
    the head of the chain). Replays on fresh inputs equal the same chain launched without PDL
    bit for bit: a program that read its input before the producer finished would not."""
    from attngraph import skinny_linear as sl

    device = _hopper()
    gen = torch.Generator(device=device).manual_seed(31)
    # q-, gate/up- and down-shaped weights (Llama-3.2-1B): each streams for microseconds
    weights = [torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
               for n, k in ((2048, 2048), (16384, 2048), (2048, 8192))]  # fmt: skip
    x_in = torch.empty(2, 2048, dtype=torch.bfloat16, device=device)

    def chain():
        h = x_in * 1.5  # a torch kernel (no PDL) produces the first input
        for _ in range(4):
            h = sl.skinny_linear(h, weights[0])
            h = sl.skinny_silu_mul_linear(*sl.skinny_linear(h, weights[1]).split(8192, dim=1), weights[2])
        return h

    graph, out = _graph_of(chain)
    for _ in range(3):
        x_in.copy_(torch.randn(2, 2048, generator=gen, device=device))
        graph.replay()
        got = out.clone()
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = chain()
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.isfinite(want).all() and torch.equal(got, want)


@pytest.mark.gpu
def test_a_chain_of_pdl_norm_folds_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    """A decoder layer's residual stream through the folded GEMVs and the standalone norm: each
    folded GEMV reads the previous GEMV's output and the residual one program of the launch
    before wrote. Replays equal launches without PDL bit for bit."""
    from attngraph import rms_norm
    from attngraph import skinny_linear as sl

    device = _hopper()
    gen = torch.Generator(device=device).manual_seed(33)
    w_qkv, w_o, w_gu, w_down = [torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
                                for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))]  # fmt: skip
    nw = (torch.randn(2048, generator=gen, device=device) * 0.1 + 1).to(torch.bfloat16)
    x_in = torch.empty(2, 2048, dtype=torch.bfloat16, device=device)

    def layers():
        h = x_in * 1.5  # a torch kernel (no PDL) produces the first residual
        y = sl.skinny_rms_norm_linear(h, nw, 1e-5, w_qkv)
        for _ in range(3):
            o = sl.skinny_linear(y[:, :2048], w_o)
            normed, h = rms_norm.add_rms_norm(o, nw, 1e-5, h)  # the norm in front of cuBLAS's gate/up
            gu = sl.skinny_linear(normed, w_gu)
            down = sl.skinny_silu_mul_linear(*gu.split(8192, dim=1), w_down)
            h_next = torch.empty_like(h)
            y = sl.skinny_rms_norm_linear(down, nw, 1e-5, w_qkv, residual=h, h_out=h_next)
            h = h_next
        return y, h

    graph, out = _graph_of(layers)
    for _ in range(3):
        x_in.copy_(torch.randn(2, 2048, generator=gen, device=device))
        graph.replay()
        got = [t.clone() for t in out]
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = layers()
        monkeypatch.setattr(pdl, "ENABLED", True)
        for g, w in zip(got, want):
            assert torch.isfinite(w).all() and torch.equal(g, w)


@pytest.mark.gpu
def test_pdl_decode_attention_in_a_cuda_graph_equals_plain_launches(monkeypatch):
    """The fused decode kernel launched with PDL after a torch kernel that writes its q, in a
    CUDA graph: outputs and the stored K/V equal a launch without PDL."""
    from attngraph.attn_backends.triton_ops.decode_attention import decode_attention_fwd

    device = _hopper()
    gen = torch.Generator(device=device).manual_seed(32)
    bs, hq, hkv, d, page, pages = 3, 32, 8, 64, 16, 64
    k_buf = torch.randn(pages * page, hkv, d, generator=gen, device=device).to(torch.bfloat16)
    v_buf = torch.randn(pages * page, hkv, d, generator=gen, device=device).to(torch.bfloat16)
    req_to_page = torch.randperm(pages, generator=gen, device=device).to(torch.int32).view(4, 16)
    rows = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([200, 37, 129], dtype=torch.int32, device=device)
    slots = torch.stack([req_to_page[r, (n - 1) // page].long() * page + (n - 1) % page for r, n in zip(rows, seq_lens)])
    q_in = torch.empty(bs, hq, d, dtype=torch.bfloat16, device=device)
    kv_in = torch.empty(bs, 2, hkv, d, dtype=torch.bfloat16, device=device)
    part_o = torch.empty(bs, hq, 8, d, dtype=torch.float32, device=device)
    part_lse = torch.empty(bs, hq, 8, dtype=torch.float32, device=device)
    counters = torch.zeros(bs * hq, dtype=torch.int32, device=device)

    def step():
        q = q_in * 1.0  # the producer of q (launched without PDL)
        out = torch.empty(bs, hq, d, dtype=torch.bfloat16, device=device)
        kv = kv_in + 0.0
        return decode_attention_fwd(
            q, k_buf, v_buf, out, req_to_page, rows, seq_lens, part_o, part_lse, page_size=page, scale=d**-0.5,
            max_splits=8, min_split_len=32, k_new=kv[:, 0], v_new=kv[:, 1], new_loc=slots, counters=counters,
        )  # fmt: skip

    graph, out = _graph_of(step)
    for _ in range(3):
        q_in.copy_(torch.randn(bs, hq, d, generator=gen, device=device))
        kv_in.copy_(torch.randn(bs, 2, hkv, d, generator=gen, device=device))
        graph.replay()
        got, got_k = out.clone(), k_buf[slots].clone()
        monkeypatch.setattr(pdl, "ENABLED", False)
        want = step()
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert torch.isfinite(want).all() and torch.equal(got, want)
        assert torch.equal(got_k, kv_in[:, 0]) and torch.equal(k_buf[slots], kv_in[:, 0])

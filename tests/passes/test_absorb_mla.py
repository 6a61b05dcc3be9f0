"""`absorb_mla`: multi-head latent attention attends over its latent (one KV head of r + p
values, kv_b absorbed into the query and the output), with the same outputs; every variant
whose equivalence the pass cannot read off the graph keeps the MHA form."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attngraph
from attngraph.passes import absorb_mla, cleanup, find_attention, lower_attention
from attngraph.passes.fuse_linears import LINEAR_TARGETS
from attngraph.runtime.accelerate import state_of

from ..hf_models import build_model
from .test_fuse_linears import dynamo_graph

H, R, NOPE, ROPE, DV, HIDDEN = 4, 16, 8, 4, 6, 32


class LatentAttention(nn.Module):
    """DeepSeek's attention as transformers writes it, with knobs that break the identity."""

    def __init__(self, kv_bias=False, extra_reader=False, rope_first=False, value_from_other=False,
                 latent_written=False):  # fmt: skip
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, H * (NOPE + ROPE), bias=False)
        self.kv_a = nn.Linear(HIDDEN, R + ROPE, bias=False)
        self.kv_b = nn.Linear(R, H * (NOPE + DV), bias=kv_bias)
        self.v_other = nn.Linear(R, H * DV, bias=False)
        self.o_proj = nn.Linear(H * DV, HIDDEN, bias=False)
        self.extra_reader, self.rope_first, self.value_from_other = extra_reader, rope_first, value_from_other
        self.latent_written = latent_written

    def forward(self, x):  # [B, S, HIDDEN]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, H, NOPE + ROPE).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [NOPE, ROPE], dim=-1)
        c, k_rot = torch.split(self.kv_a(x), [R, ROPE], dim=-1)
        c = F.layer_norm(c, (R,)).view(b, 1, s, R)
        k_rot = torch.tanh(k_rot.view(b, 1, s, ROPE))  # stands for RoPE (token-wise)
        q_rot = torch.tanh(q_rot)
        kv = self.kv_b(c).view(b, s, -1, NOPE + DV).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, DV], dim=-1)
        if self.value_from_other:
            v = self.v_other(c).view(b, s, H, DV).transpose(1, 2)
        key = kv.new_empty(b, H, s, NOPE + ROPE)
        if self.rope_first:
            key[..., :ROPE].copy_(k_rot.expand(-1, H, -1, -1))
            key[..., ROPE:].copy_(k_nope)
            query = torch.cat((q_rot, q_pass), dim=-1)
        else:
            key[..., :NOPE].copy_(k_nope)
            key[..., NOPE:].copy_(k_rot.expand(-1, H, -1, -1))
            query = torch.cat((q_pass, q_rot), dim=-1)
        if self.latent_written:  # after the key and value were made from it
            c.mul_(2.0)
        out = F.scaled_dot_product_attention(query, key, v, is_causal=True, scale=0.3)
        if self.extra_reader:
            out = out + key.mean()
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def passes(module, x):
    """The graph of ``module`` through find/lower/cleanup/absorb, its sites, the rewritten
    sites, and its output before the passes."""
    gm, inputs = dynamo_graph(module, x)
    with torch.no_grad():
        want = gm(*inputs)
    sites = find_attention(gm)
    assert [s.lowerable for s in sites] == [True], [s.reason for s in sites]
    lower_attention(gm, sites)
    cleanup(gm)
    done = absorb_mla(gm, sites)
    cleanup(gm)
    return gm, inputs, sites, done, want


def kv_b_linears(gm) -> int:
    return sum(n.op == "call_function" and n.target in LINEAR_TARGETS and "kv_b" in n.args[1].name for n in gm.graph.nodes)


def test_latent_attention_is_absorbed_with_the_same_output():
    torch.manual_seed(0)
    module = LatentAttention()
    x = torch.randn(2, 9, HIDDEN)
    gm, inputs, sites, done, want = passes(module, x)
    assert done == sites
    site = sites[0]
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim) == (H, 1, R + ROPE, R)
    assert site.value_in_key and site.extra["mla"] == {"latent_dim": R, "rope_dim": ROPE, "nope_dim": NOPE, "v_head_dim": DV}
    assert "mla latent=16+rope=4" in site.describe()
    assert kv_b_linears(gm) == 0  # the per-head expansion is gone
    assert not any(n.op == "call_method" and n.target in ("copy_", "new_empty") for n in gm.graph.nodes)
    cats = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == 2 and all(n in (site.q, site.k) for n in cats)  # the MHA-form query is gone too
    with torch.no_grad():
        got = gm(*inputs)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "knob,reason",
    [
        ("kv_bias", "bias-free"),  # W c + b: the bias does not pass through the absorption
        ("extra_reader", "another user"),  # the expanded key is read elsewhere
        ("rope_first", "first piece"),  # [rope | nope]: exact too, but not the form read here
        ("value_from_other", "value"),  # the values are not kv_b's
        ("latent_written", "writes in place"),  # the latent changes after K/V were expanded from it
    ],
)
def test_variants_the_pass_cannot_read_keep_the_mha_form(knob, reason, caplog):
    torch.manual_seed(1)
    module = LatentAttention(**{knob: True})
    x = torch.randn(1, 7, HIDDEN)
    with caplog.at_level("DEBUG", logger="attngraph.passes.absorb_mla"):
        gm, inputs, sites, done, want = passes(module, x)
    assert done == [] and not sites[0].value_in_key and sites[0].num_kv_heads == H
    assert reason in caplog.text
    with torch.no_grad():
        got = gm(*inputs)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_deepseek_paged_pool_stores_the_latent_and_generates_as_hf(impl):
    model = build_model("deepseek_v3", impl)
    reference = copy.deepcopy(model)
    cfg = model.config
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4)
    runner = state_of(model).runner
    pool = runner.pool
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim, pool.value_in_key) == (1, latent, cfg.kv_lora_rank, True)
    assert pool.v_buffers[0].data_ptr() == pool.k_buffers[0].data_ptr()  # the values are the keys' columns
    assert pool.bytes_per_token(cfg.num_hidden_layers, 1, latent, cfg.kv_lora_rank, torch.float32, True) == (
        cfg.num_hidden_layers * latent * 4
    )
    assert all(s.value_in_key for s in runner.ragged.sites)
    ids = torch.randint(3, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = reference.generate(ids, **greedy)
    assert torch.equal(model.generate(ids, **greedy), want)
    assert pool.num_used_pages == 0


def test_absorb_mla_false_keeps_the_per_head_pool():
    model = build_model("deepseek_v3", "sdpa")
    attngraph.accelerate(model, attention_backend="torch_native", page_size=4, absorb_mla=False)
    pool = state_of(model).runner.pool
    cfg = model.config
    assert not pool.value_in_key and pool.num_kv_heads == cfg.num_key_value_heads
    assert (pool.head_dim, pool.v_head_dim) == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)

"""Edge cases of the attention passes, each on a tiny module written for the case.

The big HF architecture matrix (tests/compiler) covers these behaviours only indirectly; here
each one has a test of its own:

1. In-place spellings in eager attention (Falcon's ``scores /= math.sqrt(d)``, ``*=``, ``+=
   mask``, ``s = s.div_(c)`` / ``mul_`` / ``add_``, an in-place softcap): the site is found and
   lowered, and in-place ops whose storage is still observable survive cleanup. In-place writes
   the matched chain does not include (``s.masked_fill_(m, min)`` not reassigned, as in XLM; a
   write through a view of the scores; q/k/v written between their use and the attention's
   output, where the lowered op reads them) make the site refused.
2. A positional mask modified in place (directly, through any view, or through the positions it
   is built from) is not provable: the site is refused, with the reason. The writes are found by
   storage (fake tensors propagated where a graph has no example values; see also
   test_aliasing.py for graphs where only the ops' schemas are left).
3. ALiBi (a per-head bias ``slopes * distance`` added to the scores, or Bloom's
   ``baddbmm(alibi, q, k^T)`` on ``[B*H, S, D]``): refused with the reason; the paged runtime
   (`attngraph.accelerate`) raises `UnsupportedModelError` naming it.
4. Broadcasting keys/values: over the batch is refused; one KV head over every query head
   (multi-query attention written without repeat_kv) is lowered.

Every stateless check compiles through the real backend (``attention_backend="torch_native"``)
and compares with eager in fp32 on fresh random inputs: twice at the traced length (the second
call reuses the graph with new values), then at another length (a recompile with symbolic
sizes). A site that is wrongly lowered therefore shows up as a numerical mismatch, and the
refusal tests also check that what made the site unlowerable changes the eager output.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

import attngraph
from attngraph import UnsupportedModelError
from attngraph.passes import ATTENTION_OP, find_attention

from . import patterns as P

ATOL = RTOL = 1e-5
#: Sequence lengths of the three calls: traced, fresh values through the same graph, recompiled.
LENGTHS = (P.S, P.S, 13)

# Reasons the passes give (attngraph/passes/find_attention.py, mask_analysis.py).
MUTATED_MASK = "the mask is modified in place by"
MUTATED_SCORES = "the scores are modified in place by"
ADDED_BIAS = "a term is added to q @ k^T before the softmax that is not a provable mask"
BIAS_NOT_MASK = "the mask adds values other than 0 and -inf (a bias, not a mask)"
BATCH_BROADCAST = "(broadcast over the batch)"
PAGED_REFUSAL = "every attention site must be lowered"


# --------------------------------------------------------------------------- helpers
def x_input(s: int = P.S) -> torch.Tensor:
    return torch.randn(P.B, s, P.D * 4)


def causal_float_mask(s: int, device, dtype=torch.float32) -> torch.Tensor:
    """``[1, 1, S, S]``: 0 where a query may see a key, the dtype's minimum elsewhere."""
    i = torch.arange(s, device=device)
    blocked = i[None, :] > i[:, None]
    return torch.zeros(s, s, device=device, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


def alibi_slopes(h: int, device) -> torch.Tensor:
    """ALiBi's per-head slopes ``2 ** (-8 * (i + 1) / h)`` (Press et al.), built in the graph."""
    return torch.pow(2.0, -8.0 * torch.arange(1, h + 1, device=device, dtype=torch.float32) / h)


@pytest.fixture(autouse=True)
def _seed():
    """Reproducible weights and inputs; every call still draws new values."""
    torch.manual_seed(0)


def compile_check(module: torch.nn.Module, lengths=LENGTHS):
    """Compile ``module`` through the attngraph backend and assert it equals eager on fresh
    random inputs of each length; returns the backend (``.sites`` of every graph, ``.graphs``)."""
    module.eval()
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        for s in lengths:
            x = x_input(s)
            torch.testing.assert_close(compiled(x), module(x), atol=ATOL, rtol=RTOL)
    assert backend.report.num_graphs == len(set(lengths)), str(backend.report)
    return backend


def captured_graph(module: torch.nn.Module) -> tuple[torch.fx.GraphModule, list]:
    """The one Dynamo graph of ``module`` at the traced length, with its example inputs."""
    graphs = []

    def capture(gm, inputs):
        graphs.append((gm, list(inputs)))
        return gm.forward

    with torch.no_grad():
        torch.compile(module.eval(), backend=capture, fullgraph=True)(x_input())
    assert len(graphs) == 1
    return graphs[0]


def without_example_values(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Drop Dynamo's fake values from every node: the passes must then fall back to what the
    ops are (and to the shapes `find_attention` propagates from example inputs)."""
    for n in gm.graph.nodes:
        n.meta.pop("example_value", None)
        n.meta.pop("val", None)
    return gm


def num_ops(backend) -> int:
    return sum(n.target is ATTENTION_OP for gm in backend.graphs for n in gm.graph.nodes)


def assert_lowered(backend, **expected):
    """One site per graph, every one lowered, with the ``expected`` attributes."""
    sites = backend.sites
    assert len(sites) == backend.report.num_graphs, str(backend.report)
    assert all(s.lowered for s in sites), str(backend.report)
    assert num_ops(backend) == len(sites)
    for s in sites:
        for name, value in expected.items():
            got = getattr(s, name)
            if isinstance(value, float):
                assert got == pytest.approx(value), (name, got, s.reason)
            else:
                assert got == value, (name, got, s.reason)
    return sites


def assert_refused(backend, reason: str):
    """One site per graph, none lowered, each refused with ``reason`` in its text."""
    sites = backend.sites
    assert len(sites) == backend.report.num_graphs, str(backend.report)
    assert not any(s.lowered or s.lowerable for s in sites), str(backend.report)
    assert all(reason in s.reason for s in sites), str(backend.report)
    assert num_ops(backend) == 0
    return sites


def outputs_differ(module: torch.nn.Module, attr: str, value) -> bool:
    """Does setting ``module.<attr> = value`` change the eager output? (The refusal tests use it
    to show that the construct behind a refusal matters: lowering the site would be wrong.)"""
    x = x_input()
    old = getattr(module, attr)
    with torch.no_grad():
        a = module(x)
        setattr(module, attr, value)
        try:
            b = module(x)
        finally:
            setattr(module, attr, old)
    return not torch.allclose(a, b, atol=1e-3, rtol=1e-3)


# =========================================================================== 1. in-place
class InplaceEager(P.Proj):
    """Eager matmul-softmax-matmul attention (MHA) with the scale and the causal mask applied
    in place, spelled as chosen by ``form``."""

    SCALE = 0.3

    def __init__(self, form: str):
        super().__init__(heads_kv=P.HQ)
        self.form = form

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        mask = causal_float_mask(x.shape[1], x.device, x.dtype)
        s = q @ k.transpose(-1, -2)
        f = self.form
        if f == "falcon":  # FalconAttention's eager path, verbatim
            s /= math.sqrt(P.D)
            p = F.softmax(s + mask, dim=-1, dtype=x.dtype)
            return self.finish(p @ v)
        if f == "itruediv":
            s /= math.sqrt(P.D)
            s += mask
        elif f == "imul":
            s *= self.SCALE
            s += mask
        elif f == "div_":
            s = s.div_(math.sqrt(P.D))
            s = s.add_(mask)
        elif f == "mul_":
            s = s.mul_(self.SCALE)
            s = s.add_(mask)
        elif f == "softcap":  # Gemma2-style softcap, in place
            s *= self.SCALE
            s /= 5.0
            s = torch.tanh(s)
            s *= 5.0
            s += mask
        # Unassigned in-place methods: Dynamo keeps ``s`` bound to the matmul's node, so the
        # softmax reads that node and the mutations are side users of it.
        elif f == "div_ unassigned":
            s.div_(math.sqrt(P.D))
            s.add_(mask)
        elif f == "mul_ unassigned":
            s.mul_(self.SCALE)
            s.add_(mask)
        elif f == "masked_fill_ unassigned":  # XLM / Flaubert: scores.masked_fill_(mask, min)
            s *= self.SCALE
            i = torch.arange(x.shape[1], device=x.device)
            s.masked_fill_(i[None, :] > i[:, None], torch.finfo(s.dtype).min)
        # Unassigned writes through a view of the scores.
        elif f == "mT masked_fill_ unassigned":  # the causal mask, written through s.mT
            s *= self.SCALE
            i = torch.arange(x.shape[1], device=x.device)
            s.mT.masked_fill_(i[:, None] > i[None, :], torch.finfo(s.dtype).min)
        elif f == "slice fill_ unassigned":  # after the mask: key 0 hidden from every later query
            s *= self.SCALE
            s += mask
            s[..., 1:, :1].fill_(torch.finfo(s.dtype).min)
        elif f == "transpose mul_ unassigned":
            s.transpose(-1, -2).mul_(self.SCALE)
            s += mask
        else:
            raise ValueError(f)
        return self.finish(torch.matmul(s.softmax(-1), v))


INV_SQRT_D = 1.0 / math.sqrt(P.D)


@pytest.mark.parametrize(
    "form,scale,cap",
    [
        ("falcon", INV_SQRT_D, 0.0),
        ("itruediv", INV_SQRT_D, 0.0),
        ("imul", InplaceEager.SCALE, 0.0),
        ("div_", INV_SQRT_D, 0.0),
        ("mul_", InplaceEager.SCALE, 0.0),
        ("softcap", InplaceEager.SCALE, 5.0),
    ],
)
def test_inplace_scale_and_mask_add_are_lowered(form, scale, cap):
    b = compile_check(InplaceEager(form))
    for s in assert_lowered(b, kind="eager", causal=True, window_left=-1, logit_cap=cap, num_kv_heads=P.HQ):
        assert s.scale.constant == pytest.approx(scale) and not s.scale.runtime, s.reason


@pytest.mark.parametrize("form", ["div_ unassigned", "mul_ unassigned", "masked_fill_ unassigned"])
def test_unassigned_inplace_methods_on_the_scores(form):
    """Lowering must account for the mutation, or the site must be refused; never ignore it."""
    b = compile_check(InplaceEager(form))
    assert len(b.sites) == b.report.num_graphs, str(b.report)
    expected_scale = INV_SQRT_D if form.startswith("div_") else InplaceEager.SCALE
    for s in b.sites:
        if s.lowered:
            assert s.causal and s.scale.constant == pytest.approx(expected_scale), s.reason
        else:
            assert "in place" in s.reason, s.reason


@pytest.mark.parametrize("form", ["mT masked_fill_ unassigned", "slice fill_ unassigned", "transpose mul_ unassigned"])
def test_writes_to_the_scores_through_a_view_are_refused(form):
    b = compile_check(InplaceEager(form))
    assert_refused(b, MUTATED_SCORES)


@pytest.mark.parametrize("form", ["div_ unassigned", "masked_fill_ unassigned", "slice fill_ unassigned"])
def test_unassigned_writes_to_the_scores_found_without_example_values(form):
    """The same refusals on a graph without Dynamo's fake values (the op-name fallback)."""
    gm, inputs = captured_graph(InplaceEager(form))
    (site,) = find_attention(without_example_values(gm), example_inputs=inputs)
    assert not site.lowerable and MUTATED_SCORES in site.reason, site.reason


def test_xlm_masked_fill_inplace_equals_eager():
    """The same on a real model: XLM (causal, padded batch) masks its scores with
    ``scores.masked_fill_(mask, min)`` and never reassigns them; the sites are refused."""
    torch.manual_seed(0)
    cfg = transformers.XLMConfig(
        vocab_size=96, emb_dim=64, n_layers=2, n_heads=4, causal=True, max_position_embeddings=64
    )
    model = transformers.XLMWithLMHeadModel(cfg).eval()
    ids = torch.randint(5, cfg.vocab_size, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits
        ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(backend.report.sites) == cfg.n_layers, str(backend.report)
    assert all(MUTATED_SCORES in s.reason for s in backend.report.sites), str(backend.report)


class ScoresAlsoReturned(P.Proj):
    """The scores are scaled in place and then also returned: the in-place ops must survive
    cleanup even though the softmax and its product are lowered away."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = q @ k.transpose(-1, -2)
        raw = s  # aliases the storage the in-place ops below write
        s /= math.sqrt(P.D)
        s += causal_float_mask(x.shape[1], x.device, x.dtype)
        return self.finish(s.softmax(-1) @ v), raw


def test_inplace_scaled_scores_that_are_also_returned():
    b = compile_check(ScoresAlsoReturned())
    assert_lowered(b, causal=True)


class ScoresWrittenAfterwards(P.Proj):
    """The scores are zeroed in place after the attention's output: nothing the attention
    reads changes, so the site is lowered (and the write still happens)."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = q @ k.transpose(-1, -2)
        o = (s * 0.3 + causal_float_mask(x.shape[1], x.device, x.dtype)).softmax(-1) @ v
        s[..., 0].zero_()
        return self.finish(o), s


def test_scores_written_after_the_output_are_lowered():
    b = compile_check(ScoresWrittenAfterwards())
    assert_lowered(b, causal=True)


class WrittenOperand(P.Proj):
    """GQA attention (repeat_kv) whose q, k or v is written in place (``t.mul_(2)``, not
    reassigned) at the point ``form`` names: ``"<eager|sdpa>: <q|k|v> <when>"``.

    The lowered op reads q, k and v where the site's output is, the attention where it uses
    them: a write in between (after the scores, after repeat_kv's copy) makes them differ. A
    write before the first use reaches both.
    """

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, x):
        q, k, v = [t.contiguous() for t in P.qkv(self.proj(x))]  # three storages of their own
        api, when = self.form.split(": ")
        target, when = {"q": q, "k": k, "v": v}[when[0]], when[2:]
        n_rep = P.HQ // P.HKV
        if when == "before":
            target.mul_(2.0)
        if api == "sdpa":
            kr, vr = P.repeat_kv(k, n_rep), P.repeat_kv(v, n_rep)
            if when == "after repeat_kv":
                target.mul_(2.0)
            o = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        else:
            mask = causal_float_mask(x.shape[1], x.device, x.dtype)
            s = q @ P.repeat_kv(k, n_rep).transpose(-1, -2) * 0.3 + mask
            if when == "after the scores":
                target.mul_(2.0)
            o = s.softmax(-1) @ P.repeat_kv(v, n_rep)
        return self.finish(o)


OPERAND_WRITES = [  # (form, refused as which operand; None: lowered)
    ("eager: q after the scores", "query"),
    ("eager: k after the scores", "key"),
    ("eager: v after the scores", None),  # the product with v comes after the write
    ("eager: k before", None),
    ("sdpa: k after repeat_kv", "key"),
    ("sdpa: v after repeat_kv", "value"),
    ("sdpa: q after repeat_kv", None),  # SDPA reads q itself, at its output
    ("sdpa: v before", None),
]


@pytest.mark.parametrize("form,role", OPERAND_WRITES, ids=[f for f, _ in OPERAND_WRITES])
def test_qkv_written_between_their_use_and_the_output(form, role):
    b = compile_check(WrittenOperand(form))
    if role is None:
        assert_lowered(b, causal=True, num_kv_heads=P.HKV)
    else:
        for s in assert_refused(b, f"the {role} ("):
            assert "is modified in place by mul_" in s.reason and "where the lowered op would read it" in s.reason


# =========================================================================== 2. mutated mask
class MutatedMask(P.Proj):
    """A causal mask built from positions alone, then written in place before it is used.

    ``form=None`` skips the write (the plain causal mask, which is lowered).
    """

    def __init__(self, form: str | None):
        super().__init__(heads_kv=P.HQ)
        self.form = form

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s_len, f = x.shape[1], self.form
        if f == "positions":  # the positions the mask is built from are written first
            pos = torch.arange(s_len, device=x.device)
            pos[0] = s_len  # query 0 now sees every key, and no other query sees key 0
            mask = (pos[None, :] <= pos[:, None])[None, None]
            return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        if f in ("bool view setitem", "bool .mT setitem"):
            i = torch.arange(s_len, device=x.device)
            mask = (i[None, :] <= i[:, None])[None, None]
            if f == "bool view setitem":
                mask.view(s_len, s_len)[:, -1] = True  # the last key is visible to every query
            else:
                mask.mT[..., -1, :] = True
            return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        mask = causal_float_mask(s_len, x.device, x.dtype)
        low = torch.finfo(x.dtype).min
        if f == "view setitem":  # m = mask.view(...); m[..., j] = 0: the last key becomes visible
            m = mask.view(s_len, s_len)
            m[:, -1] = 0
        elif f == "slice fill_":  # the first key is hidden from every later query
            mask[:, :, 1:, :1].fill_(low)
        elif f == "direct setitem":
            mask[..., -1] = 0
        elif f == "unsqueeze view chain":
            mask[0].unsqueeze(0).squeeze(0)[0, :, -1] = 0
        elif f == "copy_ into a view":
            mask[..., -1].copy_(torch.zeros(s_len, device=x.device))
        elif f == "index_fill_":  # key 0 hidden from every query
            mask.index_fill_(-1, torch.tensor([0], device=x.device), low)
        # Views the passes do not know as views today.
        elif f == ".T attribute":
            mask[0, 0].T[-1] = 0
        elif f == "torch.diagonal":
            torch.diagonal(mask, dim1=-2, dim2=-1)[..., 1:].fill_(low)  # no query sees itself (but query 0)
        elif f == "torch.swapaxes":
            torch.swapaxes(mask, -1, -2)[..., -1, :] = 0
        elif f == "torch.t":
            torch.t(mask[0, 0])[-1] = 0
        elif f == "torch.movedim":
            torch.movedim(mask, -1, -2)[..., -1, :] = 0
        elif f == ".data":
            mask.data[..., -1] = 0
        elif f is not None:
            raise ValueError(f)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
        return self.finish(torch.matmul(w.softmax(-1), v))


@pytest.mark.parametrize(
    "form",
    [
        "view setitem",
        "slice fill_",
        "direct setitem",
        "unsqueeze view chain",
        "copy_ into a view",
        "index_fill_",
        "positions",
        "bool view setitem",
        "bool .mT setitem",
        ".T attribute",
        "torch.diagonal",
        "torch.swapaxes",
        "torch.t",
        "torch.movedim",
        ".data",
    ],
)
def test_mask_modified_in_place_is_refused(form):
    module = MutatedMask(form)
    assert outputs_differ(module, "form", None), "the write does not change the output: a useless case"
    b = compile_check(module)
    sites = assert_refused(b, MUTATED_MASK)
    assert all("outside its own computation" in s.reason for s in sites)


MASK_WRITES_BY_VIEW = [
    "view setitem", "unsqueeze view chain", "copy_ into a view", "positions", "bool .mT setitem", ".T attribute",
    "torch.diagonal", "torch.swapaxes", "torch.t", "torch.movedim", ".data", None,
]


@pytest.mark.parametrize("form", MASK_WRITES_BY_VIEW, ids=[str(f) for f in MASK_WRITES_BY_VIEW])
def test_mask_writes_found_without_example_values(form):
    """Without Dynamo's fake values `find_attention` propagates its own and decides by storage;
    the plain mask (``None``) is still lowered."""
    gm, inputs = captured_graph(MutatedMask(form))
    (site,) = find_attention(without_example_values(gm), example_inputs=inputs)
    if form is None:
        assert site.lowerable and site.causal, site.reason
    else:
        assert not site.lowerable and MUTATED_MASK in site.reason, site.reason


def test_unmodified_mask_of_the_same_module_is_lowered():
    """The control: the same module without the write is lowered as causal."""
    b = compile_check(MutatedMask(None))
    assert_lowered(b, causal=True, window_left=-1)


def test_mask_modified_in_place_in_a_hf_model(monkeypatch):
    """Llama (eager) whose attention writes into HF's causal mask through a view before using it:
    stateless compile refuses every site and equals eager; the paged runtime, where the mask is
    built from trusted position_ids, raises instead of lowering it."""
    import transformers.models.llama.modeling_llama as ml

    from ..hf_models import build_model

    original = ml.eager_attention_forward

    def hide_first_key(module, query, key, value, attention_mask, **kw):
        view = attention_mask.view(attention_mask.shape)
        view[..., 1:, 0] = torch.finfo(view.dtype).min
        return original(module, query, key, value, attention_mask, **kw)

    model = build_model("llama", "eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        plain = model(ids).logits
    monkeypatch.setattr(ml, "eager_attention_forward", hide_first_key)
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        ref = model(ids).logits
        out = compiled(ids).logits
    assert not torch.allclose(ref, plain, atol=1e-3)  # the write matters
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert backend.report.num_lowered == 0 and len(backend.report.sites) == model.config.num_hidden_layers
    assert all(MUTATED_MASK in s.reason for s in backend.report.sites), str(backend.report)

    with pytest.raises(UnsupportedModelError, match=PAGED_REFUSAL) as err:
        attngraph.accelerate(model, attention_backend="torch_native", page_size=4, kv_cache_tokens=64)
    assert "model.layers.0.self_attn" in str(err.value) and MUTATED_MASK in str(err.value)
    assert "generate" not in model.__dict__  # nothing half-applied


# =========================================================================== 3. ALiBi
class AlibiEager(P.Proj):
    """A per-head ALiBi bias ``slope_h * (j - i)`` added to the scores next to a causal mask."""

    def __init__(self, form: str | None):
        super().__init__(heads_kv=P.HQ)
        self.form = form

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s_len = x.shape[1]
        i = torch.arange(s_len, device=x.device, dtype=x.dtype)
        alibi = alibi_slopes(P.HQ, x.device)[:, None, None] * (i[None, :] - i[:, None])[None]  # [H, S, S]
        mask = causal_float_mask(s_len, x.device, x.dtype)
        s = q @ k.transpose(-1, -2)
        if self.form == "falcon":  # FalconAttention's ALiBi eager path: bias, then scale in place
            s = s + alibi
            s *= P.D ** -0.5
            p = F.softmax(s + mask, dim=-1, dtype=x.dtype)
        elif self.form == "scaled then biased":
            p = (s * P.D ** -0.5 + alibi + mask).softmax(-1)
        elif self.form == "biased then capped":  # the bias inside the softcap: not the op's order
            t = s * P.D ** -0.5 + alibi
            p = (torch.tanh(t / 0.5) * 0.5 + mask).softmax(-1)
        elif self.form is None:
            p = (s * P.D ** -0.5 + mask).softmax(-1)
        else:
            raise ValueError(self.form)
        return self.finish(p @ v)


class AlibiSdpa(P.Proj):
    """Falcon's ALiBi SDPA path: the bias folded into the float mask SDPA adds."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)
        self.use_alibi = True

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s_len = x.shape[1]
        mask = causal_float_mask(s_len, x.device, x.dtype)
        if self.use_alibi:
            i = torch.arange(s_len, device=x.device, dtype=x.dtype)
            mask = mask + alibi_slopes(P.HQ, x.device)[:, None, None] * (i[None, :] - i[:, None])
        return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class BloomBaddbmm(P.Proj):
    """BloomAttention: ``baddbmm(alibi, q, k^T, beta, alpha)`` on ``[B*H, S, D]``, viewed as
    ``[B, H, S, S]`` for the mask and the softmax, then ``bmm`` with the values in 3-D."""

    def __init__(self, form: str):
        super().__init__(heads_kv=P.HQ)
        self.form = form

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        b, h, s_len, d = q.shape
        pos = torch.arange(s_len, device=x.device, dtype=x.dtype)
        if self.form == "quadratic":  # a position bias that is not ALiBi
            pos = pos * pos
        alibi = (alibi_slopes(h, x.device)[:, None, None] * pos[None, None, :]).repeat(b, 1, 1)  # [B*H, 1, S]
        q3 = q.reshape(b * h, s_len, d)
        kt3 = k.reshape(b * h, s_len, d).transpose(-1, -2)
        v3 = v.reshape(b * h, s_len, d)
        if self.form in ("torch.baddbmm", "quadratic"):
            scores = torch.baddbmm(alibi, q3, kt3, beta=1.0, alpha=d ** -0.5)
        elif self.form == "beta":
            scores = torch.baddbmm(alibi, q3, kt3, beta=0.5, alpha=d ** -0.5)
        elif self.form == "method":  # transformers' spelling
            scores = alibi.baddbmm(batch1=q3, batch2=kt3, beta=1.0, alpha=d ** -0.5)
        else:
            raise ValueError(self.form)
        w = scores.view(b, h, s_len, -1) + causal_float_mask(s_len, x.device, x.dtype)
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(p.view(b * h, s_len, -1), v3)
        return self.finish(out.view(b, h, s_len, d))


def _expected_slopes(scale: float = 1.0) -> list[float]:
    return [x * scale for x in alibi_slopes(P.HQ, "cpu").tolist()]


@pytest.mark.parametrize("form", ["falcon", "scaled then biased"])
def test_alibi_added_to_the_scores_is_lowered_with_its_slopes(form):
    module = AlibiEager(form)
    assert outputs_differ(module, "form", None)
    b = compile_check(module)  # compiled output equals eager
    assert b.report.num_lowered == len(b.sites) > 0, str(b.report)
    # Falcon adds the bias before the scale: the slopes are scaled with the scores
    want = _expected_slopes(P.D ** -0.5 if form == "falcon" else 1.0)
    for s in b.sites:
        assert s.alibi_slopes == pytest.approx(want, rel=1e-6) and "alibi" in s.describe()


class AlibiWithSinks(P.Proj):
    """GPT-OSS-style sinks next to an ALiBi bias: the sink logit does not move with the bias's
    per-row constant, so the bias must be known exactly, which the proof does not give."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)
        self.sinks = torch.nn.Parameter(torch.randn(P.HQ))

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s_len = x.shape[1]
        i = torch.arange(s_len, device=x.device, dtype=x.dtype)
        alibi = alibi_slopes(P.HQ, x.device)[:, None, None] * i[None, None, :]  # slope * j: rows shifted by i
        w = q @ k.transpose(-1, -2) * P.D ** -0.5 + alibi + causal_float_mask(s_len, x.device, x.dtype)
        sink = self.sinks.reshape(1, -1, 1, 1).expand(x.shape[0], -1, s_len, -1)
        combined = torch.cat([w, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        p = F.softmax(combined, dim=-1)[..., :-1]
        return self.finish(p @ v)


def test_alibi_with_sinks_is_refused():
    assert len(assert_refused(compile_check(AlibiWithSinks()), "together with attention sinks")) > 0


def test_alibi_inside_a_softcap_is_refused():
    """The op adds the bias after the softcap; a bias added inside it is another function."""
    module = AlibiEager("biased then capped")
    assert outputs_differ(module, "form", "scaled then biased")
    assert len(assert_refused(compile_check(module), "inside the softcap")) > 0


def test_alibi_folded_into_the_sdpa_mask_is_lowered_with_its_slopes():
    module = AlibiSdpa()
    assert outputs_differ(module, "use_alibi", False)
    b = compile_check(module)
    assert b.report.num_lowered == len(b.sites) > 0, str(b.report)
    for s in b.sites:
        assert s.causal and s.alibi_slopes == pytest.approx(_expected_slopes(), rel=1e-6)


@pytest.mark.parametrize("form", ["torch.baddbmm", "method", "beta"])
def test_bloom_baddbmm_is_lowered_with_its_slopes(form):
    """Bloom's [batch*heads] form: the op runs on the 4-D q/k/v the reshapes merged, and
    baddbmm's ``beta * bias`` is the ALiBi bias in logit units."""
    b = compile_check(BloomBaddbmm(form))
    assert b.report.num_lowered == len(b.sites) > 0, str(b.report)
    want = _expected_slopes(0.5 if form == "beta" else 1.0)
    for s in b.sites:
        assert s.kind == "eager" and s.extra.get("merged_heads") and s.alibi_slopes == pytest.approx(want, rel=1e-6)


def test_bloom_baddbmm_with_a_bias_that_is_not_alibi_is_refused():
    b = compile_check(BloomBaddbmm("quadratic"))
    sites = assert_refused(b, "not a proven ALiBi bias")
    assert all("depends on" in s.reason for s in sites), [s.reason for s in sites]


def _alibi_hf_model(arch: str, impl: str) -> torch.nn.Module:
    """Tiny Falcon with ``alibi=True`` (MHA, old layout) or Bloom: two layers, four heads."""
    common = dict(vocab_size=96, hidden_size=64, bos_token_id=1, eos_token_id=2)
    if arch == "falcon":
        cfg = transformers.FalconConfig(
            **common, num_hidden_layers=2, num_attention_heads=4, alibi=True, new_decoder_architecture=False,
            multi_query=False,
        )
    else:
        cfg = transformers.BloomConfig(**common, n_layer=2, n_head=4)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


def test_alibi_hf_models_stateless_lower_with_the_slopes():
    """Falcon's ALiBi (its bias in the SDPA mask; eager, up to transformers 5.24: added before
    and again after the scale; from 5.25 once)."""
    from packaging.version import Version

    twice = Version(transformers.__version__).release < (5, 25)
    for impl in ("sdpa", "eager"):
        model = _alibi_hf_model("falcon", impl)
        backend = attngraph.backend(attention_backend="torch_native")
        compiled = torch.compile(model, backend=backend)
        for shape in ((2, 11), (2, 11), (3, 7)):
            ids = torch.randint(3, model.config.vocab_size, shape)
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        report = backend.report
        assert report.num_lowered == len(report.sites) == 2 * report.num_graphs, str(report)
        # 4 heads: slopes 2^(-2(h+1)) / sqrt(16), once in the mask (and once more before the eager scale)
        want = [2.0 ** (-2 * (h + 1)) / 4 * (2 if impl == "eager" and twice else 1) for h in range(4)]
        assert all(s.alibi_slopes == pytest.approx(want, rel=1e-6) for s in backend.sites), str(report)


def test_bloom_stateless_lowers_with_the_slopes():
    """Bloom (with and without a padding mask: HF builds the bias from the mask's cumsum, or
    from an arange when there is none)."""
    model = _alibi_hf_model("bloom", "eager")
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(model, backend=backend)
    for shape in ((2, 11), (3, 7)):
        ids = torch.randint(3, model.config.vocab_size, shape)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    report = backend.report
    assert report.num_lowered == len(report.sites) > 0, str(report)
    want = [2.0 ** (-2 * (h + 1)) for h in range(4)]  # baddbmm's beta = 1: the bias in logit units
    assert all(s.alibi_slopes == pytest.approx(want, rel=1e-6) for s in backend.sites), str(report)


# =========================================================================== 4. broadcasting
class BroadcastKV(P.Proj):
    """Keys/values that broadcast against the queries instead of matching them.

    ``batch`` / ``batch sdpa``: k, v of the first sequence only (``[1, H, S, D]``) for queries
    ``[B, H, S, D]``; ``query batch``: the other way round. ``mqa`` / ``mqa expand`` / ``mqa
    sdpa expand``: one KV head (``[B, 1, S, D]``) for every query head, implicitly through
    matmul broadcasting or by an explicit ``expand``.
    """

    def __init__(self, form: str):
        super().__init__(heads_kv=1 if form.startswith("mqa") else P.HQ)
        self.form = form

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), self.heads_kv)
        mask = causal_float_mask(x.shape[1], x.device, x.dtype)
        f = self.form
        if f in ("batch", "batch sdpa"):
            k, v = k[:1], v[:1]
        elif f == "query batch":
            q = q[:1]
        elif f in ("mqa expand", "mqa sdpa expand"):
            k, v = k.expand(-1, P.HQ, -1, -1), v.expand(-1, P.HQ, -1, -1)
        if f.endswith("sdpa") or f == "mqa sdpa expand":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = torch.matmul((torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask).softmax(-1), v)
        return self.finish(o.expand(x.shape[0], -1, -1, -1))


@pytest.mark.parametrize("form", ["batch", "batch sdpa", "query batch"])
def test_kv_broadcast_over_the_batch_is_refused(form):
    b = compile_check(BroadcastKV(form))
    sites = assert_refused(b, BATCH_BROADCAST)
    for s in sites:
        assert "keys/values of batch" in s.reason, s.reason


@pytest.mark.parametrize("form", ["mqa", "mqa expand", "mqa sdpa expand"])
def test_one_kv_head_broadcast_over_query_heads_is_lowered(form):
    b = compile_check(BroadcastKV(form))
    sites = assert_lowered(b, causal=True, num_q_heads=P.HQ, head_dim=P.D)
    for s in sites:
        if form == "mqa":
            # implicit matmul broadcasting: the site keeps the single KV head (GQA with one group)
            assert s.num_kv_heads == 1 and "gqa=4/1" in s.reason, s.reason
        else:
            # an explicit expand before the site: served as one head or as the expanded heads
            assert s.num_kv_heads in (1, P.HQ), s.reason

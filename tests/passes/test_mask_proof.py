"""Masks are lowered only when their pattern is proven for every length.

1. Custom positional masks through stateless `torch.compile` at lengths 10, 12, 40 and 64
   (Dynamo's second graph has a symbolic length): each site is either lowered and equal to
   eager at every length, or refused with the reason. A window spelled with other constants
   (``(i - j) // 4 < 4``, ``(i - j).float() < 16.0``) is proven to be a window of 16; a window
   that grows with the length (``i - j < S // 3``) is refused in the symbolic graph.
2. The prover on synthetic formulas: `linear_proof` (sound refutation of linear integer
   arithmetic with floor division) and `mask_analysis.prove_pattern` on hand-written
   predicates over (query row, key column, length).
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F

import attngraph
from attngraph.passes import linear_proof
from attngraph.passes.mask_analysis import MaskPattern, NotProvable, candidate_pattern, prove_pattern
from attngraph.passes.symbolic_mask import I

from . import patterns as P

LENGTHS = (10, 12, 40, 64)
NOT_AT_EVERY_LENGTH = "at every length"


class CustomMask(P.Proj):
    """MHA with a boolean mask built from ``i = arange(S)`` as ``form`` says, through SDPA or
    the eager matmul-softmax-matmul form."""

    def __init__(self, form: str, eager: bool = False):
        super().__init__(heads_kv=P.HQ)
        self.form, self.eager = form, eager

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = x.shape[1]
        i = torch.arange(s, device=x.device)[:, None]
        j = torch.arange(s, device=x.device)[None, :]
        f = self.form
        if f == "window 16 by floor division":
            m = (j <= i) & ((i - j) // 4 < 4)
        elif f == "window 16 in float":
            m = (j <= i) & ((i - j).float() < 16.0)
        elif f == "window growing with the length":
            m = (j <= i) & ((i - j) < s // 3)
        elif f == "even distances":
            m = (j <= i) & ((i - j) % 2 == 0)
        elif f == "causal":
            m = j <= i
        elif f == "chunks of 8":  # Llama 4's local layers
            m = (j <= i) & (j // 8 == i // 8)
        elif f == "chunks of 8 by remainder":
            m = (j <= i) & (j >= i - i % 8)
        elif f == "chunks of 8 from position 1":  # not the chunks the op attends in
            m = (j <= i) & ((j + 1) // 8 == (i + 1) // 8)
        elif f == "chunks growing with the length":
            m = (j <= i) & (j // (s // 4) == i // (s // 4))
        else:
            raise ValueError(f)
        m = m[None, None]
        if not self.eager:
            return self.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=m))
        bias = torch.zeros(m.shape, dtype=x.dtype, device=x.device).masked_fill(~m, torch.finfo(x.dtype).min)
        w = torch.matmul(q, k.transpose(2, 3)) * P.D ** -0.5 + bias
        return self.finish(torch.matmul(w.softmax(-1), v))


def compile_all_lengths(module: torch.nn.Module):
    """Eager vs attngraph at each of `LENGTHS` (fresh inputs); returns the backend."""
    torch.manual_seed(0)
    module.eval()
    backend = attngraph.backend(attention_backend="torch_native")
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        for s in LENGTHS:
            x = torch.randn(P.B, s, P.D * 4)
            torch.testing.assert_close(compiled(x), module(x), atol=1e-5, rtol=1e-5, msg=lambda m: f"S={s}: {m}")
    assert backend.report.num_graphs == 2, str(backend.report)  # static, then symbolic length
    return backend


CASES = [  # form, expected per graph: (static graph at S=10, symbolic graph); a window or "refused"
    ("window 16 by floor division", ("causal", 16)),  # at S=10 a window of 16 is plain causal
    ("window 16 in float", ("causal", 16)),
    ("window growing with the length", (3, "refused")),  # 10 // 3 = 3 in the static graph
    ("even distances", ("refused", "refused")),
    ("causal", ("causal", "causal")),
    ("chunks of 8", ("chunks 8", "chunks 8")),
    ("chunks of 8 by remainder", ("chunks 8", "chunks 8")),
    ("chunks of 8 from position 1", ("refused", "refused")),
    ("chunks growing with the length", ("chunks 2", "refused")),  # 10 // 4 = 2 in the static graph
]


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("form,expected", CASES, ids=[c[0] for c in CASES])
def test_custom_masks_equal_eager_at_every_length(form, expected, eager):
    backend = compile_all_lengths(CustomMask(form, eager))
    sites = backend.sites
    assert len(sites) == 2, str(backend.report)
    for site, want in zip(sites, expected):
        if want == "refused":
            assert not site.lowered and site.reason, str(backend.report)
            assert "mask" in site.reason, site.reason
        elif isinstance(want, str) and want.startswith("chunks"):
            assert site.lowered and site.causal and site.window_left == -1, str(backend.report)
            assert site.chunk_size == int(want.split()[1]), site.reason
        else:
            assert site.lowered and site.causal and site.chunk_size == 0, str(backend.report)
            assert site.window_left == (-1 if want == "causal" else want - 1), site.reason


def test_growing_window_is_refused_with_the_reason():
    backend = compile_all_lengths(CustomMask("window growing with the length"))
    symbolic = backend.sites[1]
    assert not symbolic.lowered and NOT_AT_EVERY_LENGTH in symbolic.reason, symbolic.reason
    assert "fixed window" in symbolic.reason
    assert NOT_AT_EVERY_LENGTH in str(backend.report)  # explain shows it


# --------------------------------------------------------------------------- the prover alone
r, c, s, t = I[2], I[3], sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)
SHAPE = (sympy.Integer(1), sympy.Integer(1), s, s)
RANGES = {"s0": (2, None)}


def proven(allowed, pattern: MaskPattern, shape=SHAPE, sq=s, sk=s, ranges=RANGES) -> bool:
    try:
        prove_pattern(allowed, shape, pattern, sq, sk, ranges)
        return True
    except NotProvable:
        return False


CAUSAL, FULL = MaskPattern(True), MaskPattern(False)


def window(w: int) -> MaskPattern:
    return MaskPattern(True, w - 1)


def chunks(n: int) -> MaskPattern:
    return MaskPattern(True, -1, n)


@pytest.mark.parametrize(
    "allowed,pattern,expected",
    [
        (c <= r, CAUSAL, True),
        (c < r + 1, CAUSAL, True),
        (sympy.Not(c > r), CAUSAL, True),
        (c <= r, window(8), False),
        ((c <= r) & (c > r - 8), window(8), True),
        ((c <= r) & (c > r - 8), window(9), False),
        ((c <= r) & (c > r - 8), CAUSAL, False),
        ((c <= r) & (sympy.floor((r - c) / 4) < 4), window(16), True),
        ((c <= r) & (sympy.floor((r - c) / 4) <= 4), window(20), True),
        ((c <= r) & (sympy.floor((r - c + 3) / 4) < 4), window(13), True),
        ((c <= r) & (sympy.Mod(r - c, 2) == 0), CAUSAL, False),
        ((c <= r) & (r - c < sympy.floor(s / 3)), window(3), False),  # the window grows with s
        ((c <= r) & (r - c < sympy.floor(s / 3)), CAUSAL, False),
        ((c <= r) & (r - c < s), CAUSAL, True),  # always true within the square: causal
        (sympy.Abs(r - c) >= 0, FULL, True),
        (c >= 0, FULL, True),
        (c <= r + s, FULL, True),
        (sympy.Abs(r - c) <= 3, FULL, False),
        ((c <= r) | (c <= r - 5), CAUSAL, True),
        (sympy.Piecewise((c <= r, r >= 5), (c <= r, True)), CAUSAL, True),
        (sympy.Piecewise((c <= r, r >= 5), (c <= r + 1, True)), CAUSAL, False),
        ((c <= r) & sympy.Eq(sympy.floor(c / 8), sympy.floor(r / 8)), chunks(8), True),
        ((c <= r) & (c >= r - sympy.Mod(r, 8)), chunks(8), True),
        ((c <= r) & sympy.Eq(sympy.floor(c / 8), sympy.floor(r / 8)), chunks(4), False),
        ((c <= r) & sympy.Eq(sympy.floor(c / 8), sympy.floor(r / 8)), window(8), False),
        ((c <= r) & sympy.Eq(sympy.floor(c / 8), sympy.floor(r / 8)), CAUSAL, False),
        ((c <= r) & (c > r - 8), chunks(8), False),
        ((c <= r) & sympy.Eq(sympy.floor((c + 1) / 8), sympy.floor((r + 1) / 8)), chunks(8), False),
    ],
)
def test_prove_pattern_on_synthetic_predicates(allowed, pattern, expected):
    assert proven(allowed, pattern) is expected


def test_query_offset_when_queries_are_fewer_than_keys():
    """Bottom-right alignment: query row ``r`` of ``sq`` sits at position ``r + sk - sq``."""
    shape = (sympy.Integer(1), sympy.Integer(1), s, t)
    ranges = {"s0": (2, None), "s1": (2, None)}
    assert proven(c <= r + t - s, CAUSAL, shape, s, t, ranges)
    assert not proven(c <= r, CAUSAL, shape, s, t, ranges)


def test_static_length_only_needs_that_length():
    """At one concrete length a window longer than the sequence is plain causal."""
    n = sympy.Integer(10)
    shape = (sympy.Integer(1), sympy.Integer(1), n, n)
    allowed = (c <= r) & (sympy.floor((r - c) / 4) < 4)
    assert proven(allowed, CAUSAL, shape, n, n, {})
    assert not proven(allowed, CAUSAL)  # at every symbolic length it is not


@pytest.mark.parametrize(
    "allowed,expected",
    [
        (c <= r, CAUSAL),
        ((c <= r) & (c > r - 8), window(8)),
        ((c <= r) & (sympy.floor((r - c) / 4) < 4), window(16)),
        (sympy.true, FULL),
        ((c <= r) & (r - c < sympy.floor(s / 3)), window(349525)),  # read at the long length; the proof refuses
        ((c <= r) & sympy.Eq(sympy.floor(c / 8), sympy.floor(r / 8)), chunks(8)),
        ((c <= r) & sympy.Eq(sympy.floor(c / 8192), sympy.floor(r / 8192)), chunks(8192)),
        ((c <= r) & (c >= r - sympy.Mod(r, 6)), chunks(6)),
    ],
)
def test_candidate_is_read_at_a_long_length(allowed, expected):
    assert candidate_pattern(allowed, SHAPE, s, s, RANGES) == expected


def test_candidate_refuses_a_shape_that_is_no_pattern():
    with pytest.raises(NotProvable, match="not causal, sliding-window causal, chunked causal, or full"):
        candidate_pattern(c < r, SHAPE, s, s, RANGES)  # shifted: no query sees itself


def test_linear_proof_refutes_only_what_is_refutable():
    x, y = sympy.symbols("x y", integer=True)
    assert linear_proof.unsatisfiable((2 * x >= 1) & (2 * x <= 1))  # integer tightening
    assert linear_proof.unsatisfiable((y <= x) & (sympy.floor((x - y) / 4) < 4) & (x - y >= 16))
    assert not linear_proof.unsatisfiable((y <= x) & (x - y >= 16))
    assert not linear_proof.unsatisfiable(sympy.Ne(x, y))
    with pytest.raises(linear_proof.Unsupported):
        linear_proof.unsatisfiable(x * y <= 3)
    with pytest.raises(linear_proof.Unsupported):
        linear_proof.unsatisfiable(sympy.floor(x / y) <= 3)


class LengthScale(P.Proj):
    """Eager causal attention divided by ``1 + S // 32``: a scale that changes with the length."""

    def __init__(self):
        super().__init__(heads_kv=P.HQ)

    def forward(self, x):
        q, k, v = P.qkv(self.proj(x), P.HQ)
        s = x.shape[1]
        i = torch.arange(s, device=x.device)
        mask = torch.zeros(s, s, device=x.device).masked_fill(i[None, :] > i[:, None], float("-inf"))
        w = torch.matmul(q, k.transpose(2, 3)) / torch.full([], 1.0 + s // 32, dtype=x.dtype) + mask
        return self.finish(torch.matmul(w.softmax(-1), v))


def test_scale_that_changes_with_the_length_is_not_a_constant():
    backend = compile_all_lengths(LengthScale())
    static, symbolic = backend.sites
    assert static.lowered and static.scale.constant == 1.0, static.reason
    assert not symbolic.lowered, symbolic.reason

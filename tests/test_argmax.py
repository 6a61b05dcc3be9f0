"""`attngraph.argmax.argmax_last_dim` against torch.argmax: the same index in every row, with
ties across and within chunks, signed zeros, NaN, infinities, and the layouts the decoding
loops pass (a row of a ``[steps, B]`` token buffer, a strided column, ``[B, T, V]`` logits).

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from attngraph import argmax
from attngraph.argmax import CHUNK, argmax_last_dim
from attngraph.attn_backends.triton_ops.decode_attention import interpreter_problem, interpreting
from attngraph.errors import InputError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _poison_empty(poison_empty):
    """``torch.empty`` returns NaN-filled (float) or max-filled (int) tensors (conftest)."""


@pytest.fixture
def device(monkeypatch):
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setattr(argmax, "CPU_INTERPRETER", True)
    if not interpreting():
        pytest.skip("needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1)")
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    return torch.device("cpu")


def _logits(rows: int, vocab: int, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(device)


def _check(x: torch.Tensor) -> None:
    got = argmax_last_dim(x)
    want = torch.argmax(x.cpu(), dim=-1)  # torch's CPU reduction: an independent implementation
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want), f"rows differ: {(got.cpu() != want).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (2, CHUNK), (4, CHUNK + 1), (16, 5000), (1, 3 * CHUNK - 5)])
def test_random_rows_equal_torch(device, dtype, rows, vocab):
    _check(_logits(rows, vocab, dtype, device, seed=rows * 7919 + vocab))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_index(device, dtype):
    """The maximum planted twice in one chunk, across chunks (later chunk first in value order
    of planting), and in every position of an all-equal row."""
    x = _logits(5, 3 * CHUNK + 100, dtype, device, seed=11) - 100  # every value well below 1
    x[0, [CHUNK + 5, 17]] = 1.0  # across chunks: 17 is first
    x[1, [2 * CHUNK + 9, 2 * CHUNK + 3]] = 1.0  # within the last full chunk: + 3 is first
    x[2] = 0.5  # all equal: index 0
    x[3, [CHUNK - 1, CHUNK]] = 1.0  # the chunk boundary: CHUNK - 1 is first
    x[4, -1] = 1.0  # the single maximum in the cut last chunk
    _check(x)
    assert argmax_last_dim(x).tolist() == [17, 2 * CHUNK + 3, 0, CHUNK - 1, 3 * CHUNK + 99]


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zeros_nan_and_infinities(device, dtype):
    x = torch.full((6, 2 * CHUNK + 3), -1.0, dtype=dtype, device=device)
    x[0, 7], x[0, 3] = 0.0, -0.0  # -0.0 == 0.0: the first (3) wins
    x[1, [CHUNK + 4, 9]] = float("nan")  # NaN counts as largest; the first NaN
    x[1, 2] = float("inf")
    x[2] = float("-inf")  # all -inf: index 0
    x[3, [CHUNK + 1, 2 * CHUNK]] = float("inf")  # +inf tie across chunks
    x[4, 2 * CHUNK + 2] = float("nan")  # the only NaN, in the cut last chunk
    x[5, CHUNK:] = float("nan")  # every value of the later chunks NaN
    _check(x)
    assert argmax_last_dim(x).tolist() == [3, 9, 0, CHUNK + 1, 2 * CHUNK + 2, CHUNK]


def test_out_buffers_and_layouts(device):
    """A row of a token buffer, a strided column, a 3-D batch, and a non-viewable 2-D out."""
    x = _logits(6, 4099, torch.bfloat16, device, seed=5)
    want = torch.argmax(x.cpu(), dim=-1)
    tokens = torch.full((3, 6), -7, dtype=torch.int64, device=device)
    assert argmax_last_dim(x, out=tokens[1]) is not None
    assert torch.equal(tokens[1].cpu(), want) and (tokens[[0, 2]] == -7).all()
    columns = torch.full((6, 4), -7, dtype=torch.int64, device=device)
    argmax_last_dim(x, out=columns[:, 2])  # stride 4
    assert torch.equal(columns[:, 2].cpu(), want) and (columns[:, [0, 1, 3]] == -7).all()
    x3 = x.view(2, 3, 4099)
    assert torch.equal(argmax_last_dim(x3).cpu(), want.view(2, 3))
    out = torch.full((3, 2), -7, dtype=torch.int64, device=device).t()  # [2, 3], not viewable as [6]
    argmax_last_dim(x3, out=out)
    assert torch.equal(out.cpu(), want.view(2, 3))
    vector = argmax_last_dim(x[4])  # [V] -> a 0-d index
    assert vector.dim() == 0 and vector.item() == want[4].item()


def test_rows_from_a_wider_buffer(device):
    """Rows of a padded logits buffer (``logits[:bs]``, rows longer than the vocabulary)."""
    wide = _logits(4, 6000, torch.float16, device, seed=9)
    _check(wide[:3, :5000])


def test_what_the_kernels_do_not_take_is_torch_argmax(device):
    x = torch.randint(-50, 50, (3, 300), device=device)
    assert torch.equal(argmax_last_dim(x), torch.argmax(x, dim=-1))  # integers
    f = _logits(300, 3, torch.float32, device, seed=3).t()  # [3, 300], stride 3 along V
    assert torch.equal(argmax_last_dim(f), torch.argmax(f, dim=-1))
    assert argmax_last_dim(torch.empty(0, 9, device=device)).shape == (0,)
    with pytest.raises((RuntimeError, IndexError)):
        argmax_last_dim(torch.empty(2, 0, device=device))  # torch's own error for an empty V


def test_bad_out_is_refused(device):
    x = _logits(2, 50, torch.float32, device, seed=1)
    with pytest.raises(InputError, match="int64"):
        argmax_last_dim(x, out=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(InputError, match="int64"):
        argmax_last_dim(x, out=torch.zeros(3, dtype=torch.int64, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_vocabulary_of_128256_in_a_cuda_graph(rows):
    """The decode step's shape, captured once and replayed on fresh logits (the partials come
    from the graph's pool), behind a kernel that writes the logits."""
    x = torch.randn(rows, 128256, device="cuda").bfloat16()
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    argmax_last_dim(x * 1, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_last_dim(x * 1, out=out)  # the product: a kernel before, as the LM head is
    for seed in range(4):
        x.copy_(torch.randn(rows, 128256, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda())
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))

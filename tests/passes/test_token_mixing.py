"""`check_token_mixing`: only the lowered attention may move data across the token axis of a
ragged graph. Tiny functions in ragged form (``input_ids, position_ids: [1, N]``,
``logits_indices: [L]``, N and L dynamic) that must be flagged, and counterexamples whose ops
work on other axes (or permute tokens and put them back) that must pass."""

import pytest
import torch
import torch.nn.functional as F

from attngraph.passes.token_mixing import check_token_mixing

V, H = 32, 16
torch.manual_seed(0)
EMB = torch.randn(V, H)
W = torch.randn(H, H)
HEAD = torch.randn(H, V)


def ragged_graph(body):
    """Dynamo graph of ``logits(input_ids, position_ids, logits_indices)`` with ``body`` on the
    hidden states ``x: [1, N, H]`` (``pos: [1, N]``)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(input_ids, position_ids, logits_indices):
        x = F.embedding(input_ids, EMB)
        x = body(x, position_ids)
        return (x[:, logits_indices] @ HEAD)[0]

    n = 7
    ids, pos, rows = torch.randint(0, V, (1, n)), torch.arange(n)[None], torch.tensor([2, 6])
    for t, d in ((ids, 1), (pos, 1), (rows, 0)):
        torch._dynamo.mark_dynamic(t, d)
    torch.compile(forward, backend=capture, fullgraph=True, dynamic=False)(ids, pos, rows)
    return graphs[-1]


def moe_dispatch(x, pos, k=2):
    """Sort (token, choice) pairs by expert, work on the sorted rows, restore the order."""
    flat = x[0]                                                    # [N, H]
    choice = (flat @ W[:, :4]).topk(k, dim=-1).indices.reshape(-1)  # [N*k]
    sorted_ids, perm = torch.sort(choice)
    rows = flat[perm // k] * (sorted_ids[:, None] + 1.0)           # [N*k, H], sorted order
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    return rows[inv].view(-1, k, H).sum(1)[None]                   # back in token order


def moe_index_add(x, pos, k=2):
    """The same dispatch, combined by accumulating each sorted row into its token."""
    flat = x[0]
    _, perm = torch.sort((flat @ W[:, :4]).topk(k, dim=-1).indices.reshape(-1))
    return torch.zeros_like(flat).index_add(0, perm // k, flat[perm // k] * 2.0)[None]


def sorted_rows_misread(x, pos, k=2):
    flat = x[0]
    _, perm = torch.sort((flat @ W[:, :4]).topk(k, dim=-1).indices.reshape(-1))
    return torch.zeros_like(flat).index_add(0, perm % k, flat[perm // k])[None]  # % k: not a token


TOKEN_WISE = {
    "mlp_and_norm": lambda x, pos: F.silu(x @ W) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "rope_by_position": lambda x, pos: x * torch.cos(pos[..., None].float() / 10) + x.flip(-1) * torch.sin(pos[..., None].float()),
    "hidden_axis_ops": lambda x, pos: (
        x.softmax(-1) + x.cumsum(-1) + torch.sort(x, -1).values + F.pad(x[..., 1:], (0, 1)) + x.roll(1, -1)
        + F.conv1d(x.reshape(-1, 1, H), torch.ones(1, 1, 3), padding=1).reshape(x.shape)
    ),
    "heads_view": lambda x, pos: x.view(1, -1, 4, 4).transpose(1, 2).softmax(-1).transpose(1, 2).reshape(1, -1, H),
    "moe_dispatch": moe_dispatch,
    "moe_index_add": moe_index_add,
    "complex_rope": lambda x, pos: torch.view_as_real(  # Llama 4's RoPE: frequencies built with polar
        torch.view_as_complex(x.reshape(1, -1, H // 2, 2))
        * torch.polar(torch.ones(1, x.shape[1], H // 2), pos[..., None].float() / torch.arange(1, H // 2 + 1))
    ).reshape(x.shape),
}

MIXING = {
    "cumsum_over_tokens": (lambda x, pos: x.cumsum(1), "cumulative scan over the token axis"),
    "mean_over_tokens": (lambda x, pos: x - x.mean(1, keepdim=True), "reduces over the token axis"),
    "causal_conv": (
        lambda x, pos: F.conv1d(x.transpose(1, 2), torch.ones(H, 1, 3), padding=2, groups=H)[..., : x.shape[1]].transpose(1, 2),
        "convolution over the token axis",
    ),
    "shift": (lambda x, pos: F.pad(x, (0, 0, 1, 0))[:, :-1], "pads the token axis"),
    "roll": (lambda x, pos: x.roll(1, 1), "rolls the token axis"),
    "token_contraction": (lambda x, pos: x @ (x.transpose(1, 2) @ x), "contracting the token axis"),
    "token_scores": (lambda x, pos: (x @ x.transpose(1, 2)).softmax(-1) @ x, "tokens with tokens"),
    "unrestored_sort": (lambda x, pos: x[:, torch.sort(x.sum(-1)[0]).indices], "permuted and never put back"),
    "softmax_over_tokens": (lambda x, pos: x * x.sum(-1).softmax(-1)[..., None], "softmax over the token axis"),
    "sorted_rows_misread": (sorted_rows_misread, "accumulates along the token axis"),
    "pairs_read_as_tokens": (lambda x, pos: x[:, torch.sort(x.sum(-1).repeat(1, 2)[0]).indices % x.shape[1]], "token axis"),
    "outer_product": (lambda x, pos: (x.sum(-1)[:, :, None] * x.sum(-1)[:, None, :]).sum(-1)[..., None] * x, "broadcast against each other"),
}


@pytest.mark.parametrize("name", sorted(TOKEN_WISE))
def test_token_wise_graphs_pass(name):
    assert check_token_mixing(ragged_graph(TOKEN_WISE[name])) == []


@pytest.mark.parametrize("name", sorted(MIXING))
def test_token_mixing_graphs_are_flagged(name):
    body, reason = MIXING[name]
    found = check_token_mixing(ragged_graph(body))
    assert found, name
    assert any(reason in op.reason for op in found), [str(op) for op in found]


def _read_count_as_int(t):
    int(t.shape[1])  # a kernel that reads a size as an int specializes it
    return t


def test_a_token_count_fixed_while_retracing_is_not_proven():
    # A proof over a token count the re-trace fixed to a constant would follow no token axis
    # and find nothing; it must say that it proved nothing instead.
    gm = ragged_graph(MIXING["cumsum_over_tokens"][0])
    cumsum = next(n for n in gm.graph.nodes if n.target == "cumsum")
    with gm.graph.inserting_after(cumsum):
        read = gm.graph.call_function(_read_count_as_int, (cumsum,))
    cumsum.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
    read.meta["example_value"] = cumsum.meta["example_value"]
    gm.recompile()
    found = check_token_mixing(gm)
    assert len(found) == 1 and "fixed the token count" in found[0].reason, [str(op) for op in found]


def test_moe_dispatch_really_is_token_wise():
    # The pass accepts the sort/restore pattern because rows come back in order: check it.
    x = torch.randn(1, 9, H)
    whole = moe_dispatch(x, None)
    for t in range(9):
        torch.testing.assert_close(moe_dispatch(x[:, t : t + 1], None)[0, 0], whole[0, t])


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank, so that tensor-parallel collectives can be traced."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch built without distributed")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        yield dist.group.WORLD
        dist.destroy_process_group()
    else:
        yield dist.group.WORLD


def test_tensor_parallel_collectives_are_token_wise(one_rank_group):
    """transformers' tensor parallelism: all-reduce of row-parallel outputs, all-gather of the
    column-parallel lm_head along the hidden dims (``[1, N, V/R] -> [R, N, V/R]`` underneath)."""
    from torch.distributed import _functional_collectives as funcol

    def body(x, pos):
        x = funcol.all_reduce(x @ W, "sum", one_rank_group)
        gathered = funcol.all_gather_tensor(x, 0, one_rank_group)  # [R, N, H]: ranks along dim 0
        return torch.cat(gathered.chunk(one_rank_group.size(), 0), dim=2)  # [1, N, R * H]

    assert check_token_mixing(ragged_graph(body)) == []


def test_a_gather_along_the_token_axis_is_flagged(one_rank_group):
    from torch.distributed import _functional_collectives as funcol

    found = check_token_mixing(ragged_graph(lambda x, pos: funcol.all_gather_tensor(x[0], 0, one_rank_group)[None]))
    assert any("along the token axis" in op.reason for op in found), [str(op) for op in found]

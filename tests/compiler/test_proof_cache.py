"""`compiler.proof_cache`: the token-mixing proof read back for the same graph, proved again
for any other graph, and never read from an unusable entry."""

import json

import pytest

from attngraph.compiler.proof_cache import CACHE_ENV, cached_token_mixing, graph_key
from attngraph.passes.token_mixing import check_token_mixing

from ..passes.test_token_mixing import MIXING, TOKEN_WISE, ragged_graph

TOK, ROWS = ("input_ids", "position_ids"), ("logits_indices",)


def _never():
    raise AssertionError("the proof ran although the cache holds this graph")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path / "token_mixing"


@pytest.mark.parametrize("name", ["causal_conv", "mlp_and_norm"])
def test_findings_round_trip_and_the_second_call_does_not_prove(cache, name):
    body = MIXING[name][0] if name in MIXING else TOKEN_WISE[name]
    gm = ragged_graph(body)
    calls = []

    def prove():
        calls.append(1)
        return check_token_mixing(gm, TOK, ROWS)

    first = cached_token_mixing(gm, TOK, ROWS, prove)
    assert calls == [1] and len(list(cache.iterdir())) == 1
    assert bool(first) == (name in MIXING)
    again = cached_token_mixing(ragged_graph(body), TOK, ROWS, _never)  # a fresh trace of the same graph
    assert again == first


def test_another_graph_or_other_token_inputs_are_proved_again(cache):
    a, b = ragged_graph(TOKEN_WISE["mlp_and_norm"]), ragged_graph(MIXING["cumsum_over_tokens"][0])
    assert graph_key(a, TOK, ROWS) != graph_key(b, TOK, ROWS)
    assert graph_key(a, TOK, ROWS) != graph_key(a, ("input_ids",), ROWS)
    cached_token_mixing(a, TOK, ROWS, lambda: check_token_mixing(a, TOK, ROWS))
    found = cached_token_mixing(b, TOK, ROWS, lambda: check_token_mixing(b, TOK, ROWS))
    assert found and "token axis" in found[0].reason


def test_an_unreadable_entry_is_proved_again_and_rewritten(cache):
    gm = ragged_graph(MIXING["roll"][0])
    want = cached_token_mixing(gm, TOK, ROWS, lambda: check_token_mixing(gm, TOK, ROWS))
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    assert cached_token_mixing(gm, TOK, ROWS, lambda: check_token_mixing(gm, TOK, ROWS)) == want
    assert json.loads(entry.read_text())["findings"][0]["reason"] == want[0].reason


def test_off_never_writes(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gm = ragged_graph(TOKEN_WISE["heads_view"])
    assert cached_token_mixing(gm, TOK, ROWS, lambda: check_token_mixing(gm, TOK, ROWS)) == []
    assert not any(tmp_path.rglob("*.json"))

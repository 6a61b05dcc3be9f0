import pickle

import pytest

import attngraph
from attngraph import CompileConfig, ConfigError


def test_defaults_are_valid_and_frozen():
    cfg = CompileConfig()
    assert cfg.cuda_graph_capture_sizes[:4] == (1, 2, 4, 8) and cfg.cuda_graph_capture_sizes[-1] == 256
    with pytest.raises(Exception):
        cfg.page_size = 4  # frozen


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(attention_backend="nope"), "attention_backend"),
        (dict(decode_attention_backend="nope"), "decode_attention_backend"),
        (dict(verify_attention_backend="nope"), "verify_attention_backend"),
        (dict(draft_attention_backend="nope"), "draft_attention_backend"),
        (dict(cuda_graph="sometimes"), "cuda_graph"),
        (dict(piece_compiler="tvm"), "piece_compiler"),
        (dict(page_size=0), "page_size"),
        (dict(page_size=True), "page_size"),
        (dict(kv_cache_tokens=1024, kv_memory_fraction=0.5), "not both"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
        (dict(cuda_graph_capture_sizes=(0, 2)), "capture_sizes"),
        (dict(max_requests=0), "max_requests"),
        (dict(trace_tokens=1), "trace_tokens"),
        (dict(trace_tokens=64.0), "trace_tokens"),
        (dict(fuse_linears="no"), "fuse_linears must be True or False"),
        (dict(rank_one_products=1), "rank_one_products must be True or False"),
        (dict(skinny_linears="yes"), "skinny_linears must be None"),
        (dict(deterministic=1), "deterministic"),
        (dict(lower_attention=None), "lower_attention"),
        (dict(fold_rope=False, fold_rope_linear=True), "set fold_rope=True with it"),
        (dict(fuse_attention_o=True, fold_rope_linear=True), "set fold_rope=True with it"),
        (dict(fold_rope="on"), "fold_rope must be None"),
        (dict(fold_norm_epilogue=True, fold_rms_norm=False), "set fold_rms_norm=True with it"),
        (dict(fold_norm_epilogue="on"), "fold_norm_epilogue must be True or False"),
        (dict(fuse_gated_mlp=True, fold_rms_norm=False), "set fold_rms_norm=True with it"),
        (dict(fuse_gated_mlp=1), "fuse_gated_mlp must be None"),
        (dict(flashinfer_decode_tensor_cores="1"), "flashinfer_decode_tensor_cores must be None"),
        (dict(flashinfer_extend="ragged"), "flashinfer_extend='ragged'; choose one of"),
        (dict(deterministic=True, flashinfer_decode_tensor_cores=False), "needs FlashInfer's tensor-core decode"),
        (dict(deterministic=True, flashinfer_extend="ragged_merge"), "use flashinfer_extend='auto' or 'paged'"),
    ],
)
def test_bad_values_raise_at_construction(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        CompileConfig(**kwargs)


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="page_sise"):
        CompileConfig.from_kwargs(page_sise=4)
    with pytest.raises(ConfigError, match="page_sise"):
        attngraph.backend(page_sise=4)


def test_capture_sizes_sorted_and_deduplicated():
    assert CompileConfig(cuda_graph_capture_sizes=(8, 1, 8, 2)).cuda_graph_capture_sizes == (1, 2, 8)


def test_skinny_linears_default_is_cuda_only():
    assert CompileConfig().resolved_skinny_linears("cuda") and not CompileConfig().resolved_skinny_linears("cpu")
    assert CompileConfig(skinny_linears=True).resolved_skinny_linears("cpu")
    assert not CompileConfig(skinny_linears=False).resolved_skinny_linears("cuda")


def test_config_pickles():
    cfg = CompileConfig(attention_backend="torch_native", page_size=4)
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_debug_env_dumps_graphs(monkeypatch, tmp_path, caplog):
    import torch

    monkeypatch.setenv("ATTNGRAPH_DEBUG", "1")
    cfg = CompileConfig()
    assert cfg.debug_dump_dir
    cfg = cfg.replace(debug_dump_dir=str(tmp_path))
    f = torch.compile(
        lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
        backend=attngraph.compiler.AttnGraphBackend(cfg),
    )
    with caplog.at_level("WARNING"):
        f(torch.randn(1, 2, 5, 8))
    dumped = sorted(p.name for p in tmp_path.rglob("*.py"))
    assert dumped == ["0-dynamo.py", "1-lower_attention.py", "2-cleanup.py"]
    assert str(tmp_path) in caplog.text


@pytest.mark.parametrize(
    "kwargs,folded",
    [({}, True), (dict(fuse_attention_o=True), False), (dict(fold_rope=True, fuse_attention_o=True), True),
     (dict(fold_rope=False), False)],
)
def test_fold_rope_defaults_on_unless_attention_and_projection_fuse(kwargs, folded):
    """The rotation folds by default; the fused attention + projection kernel does not rotate,
    so asking for it alone keeps the rotation where HF has it, and an explicit value wins."""
    assert CompileConfig(**kwargs).resolved_fold_rope is folded


@pytest.mark.parametrize(
    "kwargs, fused",
    [({}, True), (dict(fold_rms_norm=False), False), (dict(fuse_gated_mlp=False), False),
     (dict(fuse_gated_mlp=True), True)],
)  # fmt: skip
def test_fuse_gated_mlp_defaults_on_with_the_norm_fold(kwargs, fused):
    """``None`` (the default) follows `fold_rms_norm`, whose add + RMSNorm op the pass reads, so
    turning the norm fold off alone is still a valid configuration."""
    assert CompileConfig(**kwargs).resolved_fuse_gated_mlp is fused

"""FlashInfer backend against the torch_native reference (float32), on the GPU.

Only a few FlashInfer kernel variants are used, so that a machine JIT-compiles (or loads from
FlashInfer's kernel cache) few modules: bf16 head_dim 64/128 plain and with a sliding window,
softcap (with or without window) at head_dim 128, fp16 head_dim 64/128 plain. Each other
variant would JIT-compile for a minute or more on first use; the attention-sink test builds
one (the sink wrapper at head_dim 64 without a window, 20-90 s).
The sweep is sampled (seeded), not a full product. Poisoning: unused KV slots, the slots of
the new tokens and freed allocator memory hold values that would visibly change the result if
a kernel read them or left an output row unwritten.
"""

import copy
import dataclasses
import math
import random
import zlib

import pytest
import torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

from attngraph.attn_backends.base import AttentionLayer  # noqa: E402
from attngraph.attn_backends.torch_native import TorchNativeBackend  # noqa: E402
from attngraph.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from attngraph.runtime.kv_pool import KVPool  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
#: (dtype, head_dim, window, softcap) with prebuilt kernels.
PREBUILT = [
    (BF16, 64, False, False),
    (BF16, 128, False, False),
    (BF16, 64, True, False),
    (BF16, 128, True, False),
    (BF16, 128, False, True),
    (BF16, 128, True, True),
    (FP16, 64, False, False),
    (FP16, 128, False, False),
]
POISON = 100.0  # large finite: a wrongly read key dominates the softmax
TOL = {BF16: dict(atol=2e-2, rtol=2e-2), FP16: dict(atol=4e-3, rtol=4e-3)}


def get_backend(**kw):
    from attngraph.attn_backends.registry import get_backend_class

    return get_backend_class("flashinfer")(None, **kw)


def poison_allocator(nbytes=512 << 20):
    """Leave NaN bytes in the caching allocator so uninitialised outputs read as NaN."""
    torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xFF)


@dataclasses.dataclass
class Step:
    pool: KVPool
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref_pool: KVPool  # float32 clone taken before the step wrote anything


def new_pool(*, dtype, hkv, d, page_size, num_tokens, max_len, max_requests, num_layers=1):
    num_pages = -(-num_tokens // page_size) + max_requests + 4
    return KVPool(
        num_layers, hkv, d, num_pages, page_size, dtype, "cuda",
        max_requests=max_requests, max_context_len=max_len + page_size,
    )


def make_step(gen, *, dtype, hq, hkv, d, page_size, prefix_lens, extend_lens, mode, num_layers=1, pool=None):
    """A pool holding random prefixes (everything else poisoned) and a batch of new tokens.

    With ``pool`` given, its requests are freed and the step is laid out in it again (same
    tensors, as a CUDA-graph replay needs)."""
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    bsz = len(seq)
    if pool is None:
        pool = new_pool(dtype=dtype, hkv=hkv, d=d, page_size=page_size, num_tokens=sum(seq),
                        max_len=max(seq), max_requests=bsz + 3, num_layers=num_layers)
    for row in range(pool.max_requests):
        pool.free_request(row)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.fill_(POISON)
    spare = [pool.alloc_request() for _ in range(pool.max_requests)]
    rows = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen))).sample(spare, bsz)
    for frac in (0.3, 0.7, 1.0):  # grow in rounds: interleaved, non-contiguous pages per request
        pool.reserve(rows, [max(1, int(n * frac)) for n in seq])
    rows_t, pre_t = torch.tensor(rows), torch.tensor(prefix_lens)
    slots = pool.slots_for(rows_t, torch.zeros_like(pre_t), pre_t)
    cgen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    for layer_id in range(num_layers):
        n = slots.numel()
        pool.write(
            layer_id, slots,
            torch.randn(n, hkv, d, device="cuda", generator=cgen),
            torch.randn(n, hkv, d, device="cuda", generator=cgen),
        )
    ref_pool = copy.copy(pool)
    ref_pool.k_buffers = [b.float() for b in pool.k_buffers]
    ref_pool.v_buffers = [b.float() for b in pool.v_buffers]
    ref_pool.dtype = torch.float32
    t = sum(extend_lens)
    batch = ForwardBatch.build(pool, rows, prefix_lens, extend_lens, torch.zeros(t, dtype=torch.long), mode=mode)
    q = torch.randn(t, hq, d, device="cuda", generator=cgen).to(dtype)
    k = torch.randn(t, hkv, d, device="cuda", generator=cgen).to(dtype)
    v = torch.randn(t, hkv, d, device="cuda", generator=cgen).to(dtype)
    return Step(pool, batch, q, k, v, ref_pool)


def load_step(static: Step, step: Step) -> None:
    """Copy ``step``'s batch and q/k/v into the captured ``static`` step's tensors (a replay's
    inputs), and its host lengths into the static batch."""
    b = static.batch
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
        getattr(b, name).copy_(getattr(step.batch, name))
    for name in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"):
        setattr(b, name, getattr(step.batch, name))
    static.q.copy_(step.q)
    static.k.copy_(step.k)
    static.v.copy_(step.v)


def capture_decode(backend, layer: AttentionLayer, static: Step, bsz: int):
    """A FULL decode graph of ``layer`` on ``static``'s batch (metadata kernel + attention),
    after one warm-up outside the capture (lazy module state); returns ``(graph, out)``."""
    backend.init_cuda_graph_state(max_bs=bsz, max_num_tokens=bsz)
    backend.init_forward_metadata_out_graph(static.batch, in_capture=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.init_forward_metadata_in_graph(static.batch)
        backend.forward(static.q, static.k, static.v, layer, static.batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(static.batch)
        out = backend.forward(static.q, static.k, static.v, layer, static.batch)
    return graph, out


def reference(step: Step, layer: AttentionLayer, q=None, k=None, v=None):
    q, k, v = (step.q if q is None else q), (step.k if k is None else k), (step.v if v is None else v)
    batch = dataclasses.replace(step.batch, kv_pool=step.ref_pool)
    return TorchNativeBackend().forward(q.float(), k.float(), v.float(), layer, batch, save_kv_cache=True)


def sample_cases(mode: str, seed: int = 0):
    """One case per prebuilt variant. Batch size, GQA group and page size cycle (with a
    per-mode shift) so that each value meets several variants; lengths are random, one of
    them an exact multiple of 16 (a full last page)."""
    rng = random.Random(f"{mode}-{seed}")
    shift = {"decode": 0, "extend": 1, "extend_prefix": 2}[mode] + seed
    cases = []
    for idx, (dtype, d, window, cap) in enumerate(PREBUILT):
        i = idx + shift
        group = (1, 4, 8)[i % 3]
        hkv = (8, 2, 4, 1)[i % 4] if group == 8 else (2, 4, 8)[i % 3]
        page_size = (16, 1)[(i // 2) % 2]
        if mode == "decode":
            bsz = (64, 1, 16, 5)[i % 4]
            seq = [rng.randint(2, 4096) for _ in range(bsz)]
            seq[-1] = 16 * rng.randint(1, 256)
            prefix, ext = [s - 1 for s in seq], [1] * bsz
        else:
            bsz = (8, 1, 3)[i % 3]
            ext = [rng.randint(1, 700) for _ in range(bsz)]
            if mode == "extend_prefix":
                prefix = [rng.choice([0, rng.randint(1, 3000)]) for _ in range(bsz)]
                prefix[0] = max(prefix[0], 17)
            else:
                prefix = [0] * bsz
            ext[-1] += -(prefix[-1] + ext[-1]) % 16
        cases.append(dict(
            dtype=dtype, d=d, hq=hkv * group, hkv=hkv, page_size=page_size,
            prefix=prefix, ext=ext,
            window=rng.choice([7, 100, 1000]) if window else -1,
            cap=rng.choice([20.0, 50.0]) if cap else 0.0,
            scale=rng.choice([1 / math.sqrt(d), 0.05]),
        ))
    return cases


def case_id(c):
    return (
        f"{str(c['dtype'])[6:]}-d{c['d']}-g{c['hq'] // c['hkv']}-p{c['page_size']}-b{len(c['ext'])}"
        f"-w{c['window']}-cap{c['cap']:g}"
    )


def run_case(c, mode, extend_impl="paged", **backend_options):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mode}{extend_impl}{case_id(c)}".encode()))
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    step = make_step(
        gen, dtype=c["dtype"], hq=c["hq"], hkv=c["hkv"], d=c["d"], page_size=c["page_size"],
        prefix_lens=c["prefix"], extend_lens=c["ext"], mode=fmode,
    )
    layer = AttentionLayer(0, c["hq"], c["hkv"], c["d"], c["d"], c["scale"], True, c["window"], c["cap"])
    backend = get_backend(extend_impl=extend_impl, **backend_options)
    poison_allocator()
    backend.init_forward_metadata(step.batch)
    out = backend.forward(step.q, step.k, step.v, layer, step.batch)
    want = reference(step, layer)
    assert out.shape == want.shape and out.dtype == c["dtype"]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, **TOL[c["dtype"]])


@pytest.mark.parametrize("c", sample_cases("decode"), ids=case_id)
def test_decode(c):
    run_case(c, "decode")


@pytest.mark.parametrize("mode,seed", [("extend", 1), ("extend_prefix", 3)])
def test_extend_auto(mode, seed):
    """The default ``"auto"``: ragged kernel for steps without any cached prefix, (b) otherwise."""
    for c in sample_cases(mode, seed=seed)[:3]:
        run_case(c, mode, extend_impl="auto")


@pytest.mark.parametrize("c", sample_cases("decode", seed=1)[::2], ids=case_id)
def test_decode_tensor_cores(c):
    """Both decode kernels whatever the GQA group: tensor cores (prefill-style) and CUDA cores."""
    run_case(c, "decode", decode_tensor_cores=True)
    run_case(c, "decode", decode_tensor_cores=False)


@pytest.mark.parametrize("mode", ["decode", "extend_prefix"])
def test_deterministic_fixed_split(mode):
    """``deterministic=True``: fixed KV split size (tensor-core decode); still right."""
    for c in sample_cases(mode, seed=2)[:3]:
        run_case(c, mode, deterministic=True)


@pytest.mark.parametrize("c", sample_cases("extend"), ids=case_id)
def test_extend_no_prefix(c):
    run_case(c, "extend")


@pytest.mark.parametrize("c", sample_cases("extend_prefix"), ids=case_id)
def test_extend_with_prefix(c):
    run_case(c, "extend_prefix")


@pytest.mark.parametrize("c", sample_cases("extend_prefix", seed=1)[:6:2], ids=case_id)
def test_extend_ragged_merge(c):
    """Design (a): ragged new tokens + paged prefix merged by LSE (window kinds fall back to (b))."""
    run_case(c, "extend_prefix", extend_impl="ragged_merge")


def test_two_layer_kinds_planned_once_per_step():
    """Gemma-2 style: a window+softcap layer and a global layer share one step's metadata."""
    gen = torch.Generator().manual_seed(7)
    d, hq, hkv = 128, 16, 4
    layers = [
        AttentionLayer(0, hq, hkv, d, d, 1 / math.sqrt(d), True, 50, 30.0),
        AttentionLayer(1, hq, hkv, d, d, 1 / math.sqrt(d), True, -1, 0.0),
    ]
    for mode, prefix, ext in ((ForwardMode.EXTEND, [0, 90, 300], [64, 30, 5]), (ForwardMode.DECODE, [70, 900, 33], [1, 1, 1])):
        step = make_step(gen, dtype=BF16, hq=hq, hkv=hkv, d=d, page_size=16, prefix_lens=prefix,
                         extend_lens=ext, mode=mode, num_layers=2)
        backend = get_backend()
        backend.set_layer_kinds(layers)
        plans = []
        orig = backend._plan
        backend._plan = lambda meta, kind: plans.append(kind) or orig(meta, kind)
        backend.init_forward_metadata(step.batch)
        for layer in layers * 2:  # each kind used twice: no re-plan
            out = backend.forward(step.q, step.k, step.v, layer, step.batch)
            torch.testing.assert_close(out.float(), reference(step, layer), **TOL[BF16])
        assert len(plans) == 2 and len(set(plans)) == 2


@pytest.mark.parametrize("group,window,options", [(4, 64, {}), (8, -1, {}), (4, -1, {"deterministic": True})])
def test_decode_cuda_graph_replay(group, window, options):
    """FULL decode graph: capture once, then per step refresh the metadata out of the graph
    (plan) and replay (metadata kernel + attention) with new rows, lengths and pages."""
    d, hkv, bsz, page_size, max_len = 128, 4, 8, 16, 600
    hq = hkv * group
    layer = AttentionLayer(0, hq, hkv, d, d, 1 / math.sqrt(d), True, window, 0.0)
    gen = torch.Generator().manual_seed(group)
    pool = new_pool(dtype=BF16, hkv=hkv, d=d, page_size=page_size, num_tokens=bsz * max_len,
                    max_len=max_len, max_requests=bsz + 3)

    def step_in_pool():
        seq = torch.randint(2, max_len, (bsz,), generator=gen).tolist()
        return make_step(gen, dtype=BF16, hq=hq, hkv=hkv, d=d, page_size=page_size,
                         prefix_lens=[n - 1 for n in seq], extend_lens=[1] * bsz,
                         mode=ForwardMode.DECODE, pool=pool)

    static = step_in_pool()
    backend = get_backend(**options)
    backend.set_layer_kinds([layer])
    graph, out = capture_decode(backend, layer, static, bsz)
    for _ in range(3):
        step = step_in_pool()  # same pool tensors, new layout and contents
        load_step(static, step)
        backend.init_forward_metadata_out_graph(static.batch, in_capture=False)
        graph.replay()
        torch.testing.assert_close(out.float(), reference(step, layer), **TOL[BF16])


@pytest.mark.parametrize("causal,sq,sk,window,cap", [(True, 37, 37, -1, 0.0), (True, 5, 300, 64, 0.0), (False, 20, 90, -1, 30.0)])
def test_dense(causal, sq, sk, window, cap):
    gen = torch.Generator().manual_seed(sq)
    b, hq, hkv, d = 3, 16, 4, 128
    layer = AttentionLayer(0, hq, hkv, d, d, 1 / math.sqrt(d), causal, window, cap)
    q = torch.randn(b * sq, hq, d, generator=gen).to("cuda", BF16)
    k = torch.randn(b * sk, hkv, d, generator=gen).to("cuda", BF16)
    v = torch.randn(b * sk, hkv, d, generator=gen).to("cuda", BF16)
    backend = get_backend()
    poison_allocator()
    out = backend.forward_dense(q, k, v, layer, b)
    want = TorchNativeBackend().forward_dense(q.float(), k.float(), v.float(), layer, b)
    torch.testing.assert_close(out.float(), want, **TOL[BF16])
    out2 = backend.forward_dense(q, k, v, layer, b)  # cached plan
    torch.testing.assert_close(out2, out)


def test_attention_sinks_decode_extend_graph_and_dense():
    """Sink logits through FlashInfer's sink wrapper, against torch_native: eager decode, extend
    over cached prefixes ("auto" must not take the ragged merge, which would count a sink
    twice), a captured decode graph replayed with new lengths, and the dense form. Strong sinks
    (a few heads' sink outweighs its keys) so that a sink dropped or doubled shows."""
    d, hkv, group, page_size = 64, 2, 4, 16
    hq = hkv * group
    gen = torch.Generator().manual_seed(11)
    sinks = (torch.randn(hq, generator=gen) * 2 + torch.tensor([0.0, 6.0] * (hq // 2))).to("cuda", BF16)
    layer = AttentionLayer(0, hq, hkv, d, d, 1 / math.sqrt(d), True, -1, 0.0, sinks=sinks)
    assert layer.has_sinks
    backend = get_backend(extend_impl="auto")
    backend.set_layer_kinds([dataclasses.replace(layer, sinks=None)])  # kinds known before tensors
    for mode, prefix, ext in (("decode", [40, 1000, 3], [1, 1, 1]), ("extend", [0, 300, 17], [33, 9, 200]),
                              ("extend", [0, 0], [64, 5])):  # fmt: skip
        fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
        step = make_step(gen, dtype=BF16, hq=hq, hkv=hkv, d=d, page_size=page_size, prefix_lens=prefix,
                         extend_lens=ext, mode=fmode)  # fmt: skip
        poison_allocator()
        backend.init_forward_metadata(step.batch)
        out = backend.forward(step.q, step.k, step.v, layer, step.batch)
        want = reference(step, dataclasses.replace(layer, sinks=sinks.float()))
        nosink = reference(step, dataclasses.replace(layer, sinks=None, has_sinks=False))
        assert (want - nosink).abs().max() > 0.1  # the sinks matter here
        torch.testing.assert_close(out.float(), want, **TOL[BF16])

    # a captured decode graph, replayed on other lengths
    bsz, max_len = 4, 500
    pool = new_pool(dtype=BF16, hkv=hkv, d=d, page_size=page_size, num_tokens=bsz * max_len, max_len=max_len,
                    max_requests=bsz + 3)  # fmt: skip

    def step_in_pool():
        seq = torch.randint(2, max_len, (bsz,), generator=gen).tolist()
        return make_step(gen, dtype=BF16, hq=hq, hkv=hkv, d=d, page_size=page_size, prefix_lens=[n - 1 for n in seq],
                         extend_lens=[1] * bsz, mode=ForwardMode.DECODE, pool=pool)  # fmt: skip

    static = step_in_pool()
    backend = get_backend()
    backend.set_layer_kinds([dataclasses.replace(layer, sinks=None)])
    graph, out = capture_decode(backend, layer, static, bsz)
    for _ in range(2):
        step = step_in_pool()
        load_step(static, step)
        backend.init_forward_metadata_out_graph(static.batch, in_capture=False)
        graph.replay()
        torch.testing.assert_close(out.float(), reference(step, dataclasses.replace(layer, sinks=sinks.float())), **TOL[BF16])

    # the dense form
    b, sq, sk = 3, 21, 21
    q = torch.randn(b * sq, hq, d, generator=gen).to("cuda", BF16)
    k = torch.randn(b * sk, hkv, d, generator=gen).to("cuda", BF16)
    v = torch.randn(b * sk, hkv, d, generator=gen).to("cuda", BF16)
    out = get_backend().forward_dense(q, k, v, layer, b)
    want = TorchNativeBackend().forward_dense(q.float(), k.float(), v.float(), dataclasses.replace(layer, sinks=sinks.float()), b)
    torch.testing.assert_close(out.float(), want, **TOL[BF16])

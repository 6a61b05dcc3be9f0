"""Does FlashInfer's `BatchAttentionWithAttentionSinkWrapper` run on this GPU, and does it match
an explicit reference (per-head sink logits joined to the softmax, causal bottom-right), in
bf16, paged (page size 16), 8 query / 2 KV heads of dim 64?

    python3 benchmarks/check_flashinfer_sinks.py   # -> $OUT or . / sinks.json

Records per case: the first call's seconds (the JIT build of the variant), the largest error
against an fp32 reference, how much the sinks change the output, and the kernel family picked.
attngraph's FlashInfer backend plans its sink layers on this wrapper."""
import json, math, os, time, traceback
import torch
import flashinfer

dev = "cuda"
res = {"flashinfer": flashinfer.__version__}
hq, hkv, d, page = 8, 2, 64, 16
torch.manual_seed(0)


def reference(q, k, v, sinks, scale, q_pos):
    # q [n, Hq, D]; k/v [L, Hkv, D]; q_pos [n]
    g = hq // hkv
    kr, vr = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    s = torch.einsum("nhd,lhd->hnl", q.float(), kr) * scale
    j = torch.arange(k.shape[0], device=dev)
    s = s.masked_fill(j[None, None, :] > q_pos[None, :, None], float("-inf"))
    s = torch.cat([s, sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", p, vr)


def run_case(name, kv_lens, q_lens, backend, sink_shift=0.0):
    out = {}
    try:
        pages = [math.ceil(n / page) for n in kv_lens]
        total = sum(pages)
        kc = torch.randn(total, page, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(total, page, hkv, d, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(total, device=dev).int()
        kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), device=dev, dtype=torch.int32)
        last = torch.tensor([(n - 1) % page + 1 for n in kv_lens], device=dev, dtype=torch.int32)
        qo_indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), device=dev, dtype=torch.int32)
        q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=torch.bfloat16)
        sinks = torch.randn(hq, device=dev, dtype=torch.float32) * 2 + sink_shift
        scale = d ** -0.5
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        t = time.perf_counter()
        w = flashinfer.BatchAttentionWithAttentionSinkWrapper(ws, "NHD", backend=backend, q_data_type=torch.bfloat16,
                                                             kv_data_type=torch.bfloat16, head_dim_qk=d, head_dim_vo=d)
        w.plan(qo_indptr, kv_indptr, perm, last, hq, hkv, d, page, causal=True, sm_scale=scale,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        o = w.run(q, (kc, vc), sinks, scale)
        torch.cuda.synchronize()
        out["first_call_s"] = round(time.perf_counter() - t, 1)
        err = 0.0
        for b in range(len(kv_lens)):
            idx = perm[kv_indptr[b]:kv_indptr[b + 1]].long()
            k = kc[idx].reshape(-1, hkv, d)[: kv_lens[b]]
            v = vc[idx].reshape(-1, hkv, d)[: kv_lens[b]]
            qs = q[qo_indptr[b]:qo_indptr[b + 1]]
            q_pos = torch.arange(kv_lens[b] - q_lens[b], kv_lens[b], device=dev)
            ref = reference(qs, k, v, sinks, scale, q_pos)
            err = max(err, (o[qo_indptr[b]:qo_indptr[b + 1]].float() - ref).abs().max().item())
        out["output_scale"] = o.float().abs().max().item()
        nosink = reference(q[:q_lens[0]], kc[perm[:pages[0]].long()].reshape(-1, hkv, d)[:kv_lens[0]],
                           vc[perm[:pages[0]].long()].reshape(-1, hkv, d)[:kv_lens[0]], torch.full_like(sinks, -1e9), scale,
                           torch.arange(kv_lens[0] - q_lens[0], kv_lens[0], device=dev))
        out["max_abs_err"] = err
        out["sinks_matter"] = (o[:q_lens[0]].float() - nosink).abs().max().item()
        out["backend"] = getattr(w, "_backend", backend)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out["trace"] = traceback.format_exc()[-1500:]
    res[name] = out


for backend in ("auto", "fa2"):
    run_case(f"decode_{backend}", [1, 37, 600, 4096], [1, 1, 1, 1], backend)
    run_case(f"prefill_{backend}", [5, 37, 700, 4096], [5, 20, 300, 1000], backend)
    run_case(f"decode_many_{backend}", [4096] * 64, [1] * 64, backend)
    # strong sinks (about as heavy as all 4096 keys together): a sink counted once per KV split would show
    run_case(f"decode_long_strong_{backend}", [4096, 4096], [1, 1], backend, sink_shift=9.0)
    run_case(f"prefill_long_strong_{backend}", [4096, 2000], [64, 7], backend, sink_shift=9.0)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "sinks.json"), "w"), indent=1)
print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "trace"} if isinstance(v, dict) else v for k, v in res.items()}, indent=1))

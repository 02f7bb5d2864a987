"""An fp8 cache's bf16 window (cp_modules.cache.exact_window): decode queries read the sink and
their newest tokens unquantized and every other key as stored in e4m3.

Each decode output is compared with dense fp32 attention over the request's keys, where each
key is the original (in the window) or its e4m3 round trip (outside it); one process here, DCP
layouts against one process in tests/test_fp8_kv.py.
"""

from __future__ import annotations

import pytest
import torch

from cp_modules.cache.exact_window import allocate_window_buffer, check_exact_window
from cp_modules.cache.kv_dtype import dequantize_fp8, kv_scale, quantize_fp8
from cp_modules.cache.paged import allocate_kv_cache, allocate_mla_cache
from cp_modules.ops.gqa_attention import gqa_attention
from cp_modules.ops.mla_attention import mla_attention
from cp_modules.step import CPRuntime, build_step_metadata, cp_step

BS = 4
HQ, HKV, D = 4, 2, 16


def _steps():
    # (num_new per request, decode_threshold): a prefill, two decodes, a run of 3 (a
    # verification's k + 1 tokens), one more decode.
    return [([7, 20, 33], 1), ([1, 1, 1], 1), ([1, 1, 1], 1), ([3, 3, 3], 3), ([1, 1, 1], 1)]


def _rounded(x, scale, head_dim=-2):
    return dequantize_fp8(quantize_fp8(x, scale, head_dim), scale, torch.float32, head_dim)


def _visible(p, sink, recent, window):
    j = torch.arange(p + 1)
    seen = j >= (p - window + 1 if window else 0)
    exact = (j < sink) | (j >= p + 1 - recent)
    return seen, exact


def _dense(q, k, v, seen, scale, softcap):
    # q [H, D], k [L, Hkv, D] / v [L, Hkv, Dv]
    g = q.shape[0] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("hd,lhd->hl", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen[None, :], float("-inf"))
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize(
    "sink,recent,window,softcap",
    [(1, 4, None, None), (0, 5, None, None), (2, 0, None, None), (1, 4, 9, 2.5), (3, 6, 30, None)],
    ids=["sink1-recent4", "recent5", "sink2", "sliding9-softcap", "sink3-recent6-sliding30"],
)
def test_gqa_decode_reads_the_window_unquantized(sink, recent, window, softcap):
    torch.manual_seed(0)
    steps = _steps()
    lens = [sum(n[i] for n, _ in steps) for i in range(3)]
    per = -(-max(lens) // BS)
    table = torch.arange(3 * per, dtype=torch.int32).view(3, per)
    kc, vc = allocate_kv_cache(3 * per, BS, HKV, D, dtype=torch.float8_e4m3fn)
    ks, vs = kv_scale(torch.tensor([0.5, 0.25]), HKV), kv_scale(2.0, HKV)
    win = check_exact_window(sink, recent, max_query_len=3)
    buf = allocate_window_buffer(3, win, (2, HKV, D), dtype=torch.float32)
    keys = [[] for _ in range(3)]
    vals = [[] for _ in range(3)]
    done = [0, 0, 0]
    checked = 0
    for num_new, thr in steps:
        meta = build_step_metadata(CPRuntime.single(), num_new, done, block_table=table,
                                   block_size=BS, decode_threshold=thr)  # fmt: skip
        n = sum(num_new)
        q, k, v = torch.randn(n, HQ, D), torch.randn(n, HKV, D) * 3, torch.randn(n, HKV, D)
        with cp_step(meta):
            out = gqa_attention(q, k, v, (kc, vc), scale=D**-0.5, sliding_window=window,
                                softcap=softcap, kv_scales=(ks, vs),
                                fp8_window=(buf, sink, recent))  # fmt: skip
        t = 0
        for b, m in enumerate(num_new):
            keys[b].append(k[t : t + m])
            vals[b].append(v[t : t + m])
            kb, vb = torch.cat(keys[b]), torch.cat(vals[b])
            for i in range(m):
                p = done[b] + i
                if done[b] == 0:
                    continue  # prefill rows: not the window's business
                seen, exact = _visible(p, sink, recent, window)
                k_eff = torch.where(exact[:, None, None], kb[: p + 1], _rounded(kb[: p + 1], ks))
                v_eff = torch.where(exact[:, None, None], vb[: p + 1], _rounded(vb[: p + 1], vs))
                ref = _dense(q[t + i], k_eff, v_eff, seen, D**-0.5, softcap)
                torch.testing.assert_close(out[t + i], ref, atol=2e-5, rtol=2e-5)
                # ... and not the plain fp8 result (unless every key is in the window).
                if not bool(exact[seen].all()):
                    plain = _dense(q[t + i], _rounded(kb[: p + 1], ks), _rounded(vb[: p + 1], vs),
                                   seen, D**-0.5, softcap)  # fmt: skip
                    assert (out[t + i] - plain).abs().max() > 1e-4
                checked += 1
            t += m
        done = [c + m for c, m in zip(done, num_new)]
    assert checked == 3 * (1 + 1 + 3 + 1)


def test_mla_decode_reads_the_window_unquantized():
    torch.manual_seed(1)
    h, rk, dr, dn, dv = 4, 32, 16, 16, 16
    sink, recent = 1, 4
    steps = _steps()
    lens = [sum(n[i] for n, _ in steps) for i in range(3)]
    per = -(-max(lens) // BS)
    table = torch.arange(3 * per, dtype=torch.int32).view(3, per)
    cache = allocate_mla_cache(3 * per, BS, rk, dr, dtype=torch.float8_e4m3fn)
    sc = kv_scale(0.5, 1)
    win = check_exact_window(sink, recent, max_query_len=3)
    buf = allocate_window_buffer(3, win, (rk + dr,), dtype=torch.float32)
    w_uk, w_uv = torch.randn(h, dn, rk) * rk**-0.5, torch.randn(h, dv, rk) * rk**-0.5
    lat = [[] for _ in range(3)]
    done = [0, 0, 0]
    scale = (dn + dr) ** -0.5
    for num_new, thr in steps:
        meta = build_step_metadata(CPRuntime.single(), num_new, done, block_table=table,
                                   block_size=BS, decode_threshold=thr)  # fmt: skip
        n = sum(num_new)
        q, latent = torch.randn(n, h, dn + dr), torch.randn(n, rk + dr) * 2
        with cp_step(meta):
            out = mla_attention(q, latent, w_uk, w_uv, cache, scale=scale, kv_lora_rank=rk,
                                cache_scale=sc, fp8_window=(buf, sink, recent))  # fmt: skip
        t = 0
        for b, m in enumerate(num_new):
            lat[b].append(latent[t : t + m])
            lb = torch.cat(lat[b])
            for i in range(m):
                p = done[b] + i
                if done[b] == 0:
                    continue
                seen, exact = _visible(p, sink, recent, None)
                l_eff = torch.where(exact[:, None], lb[: p + 1], _rounded(lb[: p + 1], sc, -1))
                kv_c, k_pe = l_eff[:, :rk], l_eff[:, rk:]
                k_nope = torch.einsum("lr,hdr->lhd", kv_c, w_uk)
                keys = torch.cat((k_nope, k_pe[:, None].expand(-1, h, -1)), -1)
                vals = torch.einsum("lr,hdr->lhd", kv_c, w_uv)
                ref = _dense(q[t + i], keys, vals, seen, scale, None)
                torch.testing.assert_close(out[t + i], ref, atol=3e-5, rtol=3e-5)
            t += m
        done = [c + m for c, m in zip(done, num_new)]


def test_reference_with_every_key_given_exactly_is_the_unquantized_cache_bit_for_bit():
    # The CPU path reads the window inside the one reference call (paged_attention_ref's
    # ``exact``): with every visible key given unquantized, an fp8 cache gives the bf16 cache's
    # result bit for bit (the same arithmetic); with some, it differs from plain fp8.
    from cp_modules.reference.paged_decode import paged_attention_ref, paged_mla_attention_ref

    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, d, t = 6, 8, 2, 16, 3
    k16 = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    v16 = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    ks = kv_scale(float(k16.abs().max()) / 448, hkv)
    vs = kv_scale(float(v16.abs().max()) / 448, hkv)
    k8, v8 = quantize_fp8(k16, ks), quantize_fp8(v16, vs)
    bt = torch.randperm(nb, generator=g)[:4].view(1, 4).expand(t, 4).to(torch.int32)
    rows = torch.zeros(t, dtype=torch.int32)
    lens = torch.tensor([30, 17, 1], dtype=torch.int32)
    start = torch.tensor([3, 0, 0], dtype=torch.int32)
    q = torch.randn(t, 4, d, generator=g).bfloat16()
    pos = torch.arange(32).expand(t, 32)
    slot = bt[0].long()[pos // bs] * bs + pos % bs
    kx, vx = k16.flatten(0, 1)[slot], v16.flatten(0, 1)[slot]
    every = torch.ones(t, 32, dtype=torch.bool)
    want = paged_attention_ref(q, k16, v16, bt, rows, lens, 0.25, query_kv_start=start)
    got = paged_attention_ref(q, k8, v8, bt, rows, lens, 0.25, query_kv_start=start, k_scale=ks,
                              v_scale=vs, exact=(pos, kx, vx, every))  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = paged_attention_ref(q, k8, v8, bt, rows, lens, 0.25, query_kv_start=start,
                                k_scale=ks, v_scale=vs)  # fmt: skip
    some = paged_attention_ref(q, k8, v8, bt, rows, lens, 0.25, query_kv_start=start, k_scale=ks,
                               v_scale=vs, exact=(pos, kx, vx, pos >= 24))  # fmt: skip
    assert not torch.equal(some[0], plain[0]) and not torch.equal(some[0], want[0])
    # MLA: one latent head, the values the rows' first kv_lora_rank elements
    c16 = torch.randn(nb, bs, 24, generator=g).bfloat16()
    cs = kv_scale(float(c16.abs().max()) / 448, 1)
    c8 = quantize_fp8(c16, cs)
    qm = torch.randn(t, 4, 24, generator=g).bfloat16()
    want = paged_mla_attention_ref(qm, c16, bt, rows, lens, 0.2, 16)
    got = paged_mla_attention_ref(qm, c8, bt, rows, lens, 0.2, 16, kv_scale=cs,
                                  exact=(pos, c16.flatten(0, 1)[slot], every))  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_window_options_are_checked():
    with pytest.raises(ValueError, match="fp8_recent_tokens"):
        check_exact_window(0, -1)
    with pytest.raises(ValueError, match="fp8_sink_tokens"):
        check_exact_window(1.5, 2)  # type: ignore[arg-type]
    assert check_exact_window(0, 0) is None
    w = check_exact_window(1, 16, max_query_len=4)
    assert (w.sink, w.recent, w.capacity, w.max_query_len) == (1, 16, 19, 4)


def test_a_run_longer_than_the_ring_is_refused():
    win = check_exact_window(1, 4)  # runs of one token
    buf = allocate_window_buffer(2, win, (2, HKV, D), dtype=torch.float32)
    kc, vc = allocate_kv_cache(8, BS, HKV, D, dtype=torch.float8_e4m3fn)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = build_step_metadata(CPRuntime.single(), [2, 2], [5, 5], block_table=table,
                               block_size=BS, decode_threshold=2)  # fmt: skip
    q, k = torch.randn(4, HQ, D), torch.randn(4, HKV, D)
    with cp_step(meta), pytest.raises(ValueError, match="decode runs of 2 tokens"):
        gqa_attention(q, k, k, (kc, vc), scale=1.0, fp8_window=(buf, 1, 4))
    with cp_step(meta), pytest.raises(ValueError, match="window buffer"):
        gqa_attention(q, k, k, (kc, vc), scale=1.0, fp8_window=(buf[:, :3], 1, 4))
    bf = allocate_kv_cache(8, BS, HKV, D, dtype=torch.float32)
    with cp_step(meta), pytest.raises(ValueError, match="goes with an fp8 cache"):
        gqa_attention(q, k, k, bf, scale=1.0, fp8_window=(buf, 1, 4))


# ---------------------------------------------------------------------------------------------
# The engine: request rows that move between steps, static-buffer decode, speculation


def _engine_model(family="llama"):
    from recipe_configs import Family, ModelConf
    from recipe_models import build_model

    from cp_modules.modules.hf_swap import swap_attention

    kv = 8 if family == "deepseek_v3" else 2
    return swap_attention(build_model(ModelConf(family=Family(family), num_kv_heads=kv)))


def _prompts(lens, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_window_follows_each_request(family):
    # 7 prompts, 3 rows in flight (rows are reused as requests finish, batch order changes),
    # prompts chunked 8 tokens a step: the eager and static-buffer engines and each prompt
    # alone give the same tokens.
    from cp_modules.engine import GenerationEngine, SamplingParams

    prompts = _prompts([29, 1, 9, 4, 17, 6, 11])
    params = SamplingParams(max_new_tokens=9)
    kw = dict(block_size=4, max_num_tokens=8, progress=False, kv_cache_dtype="fp8_e4m3",
              kv_cache_fp8_sink=1, kv_cache_fp8_recent=4)  # fmt: skip
    model = _engine_model(family)
    plain = GenerationEngine(model, max_num_seqs=3, decode_graphs=False, **kw).generate(
        prompts, params
    )
    graphs = GenerationEngine(model, max_num_seqs=3, decode_graphs=True, **kw).generate(
        prompts, params
    )
    alone = GenerationEngine(model, max_num_seqs=1, decode_graphs=False, **kw)
    assert graphs.outputs == plain.outputs
    assert [alone.generate([p], params).outputs[0] for p in prompts] == plain.outputs
    s = plain.stats
    assert s.kv_cache_dtype == "fp8_e4m3" and s.kv_fp8_window == (1, 4)
    # Per layer [rows + 1, sink + recent, ...] in fp32: 4 x 5 slots of K and V (2 KV heads) or
    # of a latent row.
    c = model.config
    if family == "llama":
        per_slot = 2 * 2 * (c.hidden_size // c.num_attention_heads)
    else:
        per_slot = c.kv_lora_rank + c.qk_rope_head_dim
    assert s.kv_window_bytes == c.num_hidden_layers * 4 * 5 * per_slot * 4


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_window_over_every_key_equals_an_unquantized_cache(family):
    # Prompts in one chunk each, a window longer than any request: every key a decode reads
    # is unquantized, so the fp8 engine gives the fp32 cache's tokens; without the window it
    # does not.
    from cp_modules.engine import GenerationEngine, SamplingParams

    prompts = _prompts([29, 3, 17, 11], seed=7)
    params = SamplingParams(max_new_tokens=12)
    kw = dict(block_size=4, max_num_tokens=64, max_num_seqs=4, progress=False)
    model = _engine_model(family)
    want = GenerationEngine(model, **kw).generate(prompts, params).outputs
    got = GenerationEngine(model, kv_cache_dtype="fp8_e4m3", kv_cache_fp8_sink=1,
                           kv_cache_fp8_recent=64, **kw).generate(prompts, params)  # fmt: skip
    assert got.outputs == want
    plain = GenerationEngine(model, kv_cache_dtype="fp8_e4m3", **kw).generate(prompts, params)
    assert plain.outputs != want


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
def test_engine_window_speculation_equals_plain_decoding(graphs):
    # Each verified token reads its own newest tokens unquantized, as a one-token decode at
    # its position would: greedy speculation (k = 3) gives plain decoding's tokens.
    from cp_modules.engine import GenerationEngine, SamplingParams

    prompts = [p * 3 for p in _prompts([5, 7, 4], seed=3)]  # repeats the n-gram drafter finds
    kw = dict(block_size=4, max_num_tokens=32, max_num_seqs=3, progress=False,
              kv_cache_dtype="fp8_e4m3", kv_cache_fp8_sink=1, kv_cache_fp8_recent=4,
              decode_graphs=graphs)  # fmt: skip
    engine = GenerationEngine(_engine_model(), **kw)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=14))
    spec = engine.generate(prompts, SamplingParams(
        max_new_tokens=14, speculative="ngram", num_speculative_tokens=3,
        speculative_min_accepted=0,
    ))  # fmt: skip
    assert spec.outputs == plain.outputs
    assert spec.stats.spec_accepted_tokens > 0


def test_engine_window_options_are_checked():
    from cp_modules.engine import GenerationEngine

    model = _engine_model()
    with pytest.raises(ValueError, match="kv_cache_fp8_sink / kv_cache_fp8_recent"):
        GenerationEngine(model, kv_cache_fp8_recent=4, progress=False)
    with pytest.raises(ValueError, match="fp8_recent_tokens"):
        GenerationEngine(model, kv_cache_dtype="fp8_e4m3", kv_cache_fp8_recent=-1, progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_gpu_engine_window_graphs_equal_eager(family):
    # CUDA graphs capture the window's writes and reads (no host sync): replayed decode steps
    # give the eager engine's tokens; the window changes the plain fp8 result.
    from recipe_configs import Family, ModelConf
    from recipe_models import build_model

    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    mla = family == "deepseek_v3"
    conf = ModelConf(family=Family(family), num_heads=16 if mla else 4,
                     num_kv_heads=16 if mla else 2, qk_rope_head_dim=16)  # fmt: skip

    def model():
        torch.manual_seed(0)
        return swap_attention(build_model(conf).to("cuda", torch.bfloat16))

    prompts = _prompts([29, 1, 9, 4, 17, 6, 11])
    params = SamplingParams(max_new_tokens=9)
    kw = dict(block_size=16, max_num_tokens=16, max_num_seqs=3, progress=False,
              kv_cache_dtype="fp8_e4m3", kv_cache_fp8_sink=1, kv_cache_fp8_recent=4)  # fmt: skip
    eager = GenerationEngine(model(), decode_graphs=False, **kw).generate(prompts, params)
    engine = GenerationEngine(model(), decode_graphs=True, **kw)
    graphs = engine.generate(prompts, params)
    assert engine.num_graph_captures > 0
    assert graphs.outputs == eager.outputs
    assert graphs.stats.kv_window_bytes > 0


# ---------------------------------------------------------------------------------------------
# The merge kernel (CUDA's path) against its PyTorch reference, under the interpreter


@pytest.mark.parametrize("case", ["gqa", "gqa-softcap", "mla-sub"])
def test_window_merge_kernel_matches_the_reference_interpreted(case):
    from cp_modules.cache.exact_window import gather_window, merge_exact, window_decode_ranges
    from cp_modules.kernels.decode.exact_window import window_merge_triton

    torch.manual_seed(3)
    mla = case == "mla-sub"
    t, hq, hkv, d = 5, (8 if mla else 4), (1 if mla else 2), 24
    rk = 16 if mla else d
    win = check_exact_window(2, 5, max_query_len=2)
    tail = (d,) if mla else (2, hkv, d)
    buf = torch.randn(4, win.slots, *tail)
    positions = torch.tensor([0, 3, 9, 20, 41])
    r = window_decode_ranges(buf, win, torch.tensor([0, 1, 2, 0, 1]), positions, positions + 1,
                             None, (1, 0, 1))  # fmt: skip
    q = torch.randn(t, hq, d)
    out = torch.randn(t, hq, rk)
    lse = torch.randn(t, hq) * 3
    lse[0] = float("-inf")  # an empty kernel range
    out[0] = 0
    softcap = 2.0 if case == "gqa-softcap" else None
    rows = gather_window(buf, r.slots)
    sub = None
    if mla:
        # The rows to remove: the sink tokens' rows of an fp8 cache (page 4), read in fp32.
        from cp_modules.cache.exact_window import gather_cache_rows

        cache = torch.randn(12, 4, d).to(torch.float8_e4m3fn)
        table, seq = torch.arange(12, dtype=torch.int32).view(3, 4), torch.tensor([0, 1, 2, 0, 1])
        sub = (cache, table, seq, r.sink_local, None)
        ks = gather_cache_rows(cache, table, seq, r.sink_local, None, torch.float32)[:, :, None]
        k = rows[:, :, None, :]
        want = merge_exact(out, lse, q, k, k[..., :rk], r.valid, 0.3, None, k_sub=ks,
                           v_sub=ks[..., :rk], sub_valid=r.sink_valid)  # fmt: skip
    else:
        want = merge_exact(out, lse, q, rows[:, :, 0], rows[:, :, 1], r.valid, 0.3, softcap)
    got = window_merge_triton(
        out, lse, q, buf, r.slots, r.valid, 0.3, softcap, value_dim=rk,
        value_offset=0 if mla else buf.stride(2), sub_cache=sub,
        sub_valid=None if sub is None else r.sink_valid,
    )  # fmt: skip
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)

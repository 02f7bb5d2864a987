"""Speculative decoding in the engine: drafts verified as one multi-token decode step.

Greedy tokens equal plain decoding (GQA, MLA, a sliding window with sinks; n-gram, draft-model
and replay drafters), window-group blocks are rolled back to what plain decoding holds, the
rejection rule keeps the target's distribution (exactly computed distributions against many
samples, chi-square), and bad options are refused. Multi-rank (pcp2 x dcp2, every DCP backend)
and a real model: test_speculative_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from recipe_configs import Family, ModelConf
from recipe_models import build_model

from cp_modules.cache.window import window_first_visible
from cp_modules.engine import GenerationEngine, SamplingParams
from cp_modules.engine.block_groups import WindowBlockGroup
from cp_modules.engine.sampling import accept_greedy
from cp_modules.engine.speculative import (
    DraftModelDrafter,
    ReplayDrafter,
    accept_drafts,
    ngram_draft,
)
from cp_modules.engine.verification import SpeculationBackoff
from cp_modules.modules.hf_swap import swap_attention

pytestmark = pytest.mark.usefixtures("one_thread")

# Tests of the verification steps themselves verify at every step (their tiny random models
# accept few drafts, which the default back-off would answer with plain decode steps).
ALWAYS = {"speculative_min_accepted": 0}


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile ``z``
    (3.09: p = 1e-3, a correct sampler fails one run in 1000), by Wilson-Hilferty (within 1%
    of the exact value for df >= 3)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * h**0.5) ** 3


def repeated_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts that repeat text (n-gram drafts find matches) and one that does not."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (7,), generator=g).tolist()
    b = torch.randint(0, 256, (5,), generator=g).tolist()
    return [a * 4, b * 3 + a, torch.randint(0, 256, (9,), generator=g).tolist(), a[:2]]


def _conf(family: str, seed: int = 0) -> ModelConf:
    if family == "deepseek_v3":
        return ModelConf(family=Family(family), num_kv_heads=8, q_lora_rank=32, seed=seed)
    return ModelConf(family=Family(family), num_kv_heads=2, seed=seed)


def _window_model():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GptOssConfig(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
        eos_token_id=None, pad_token_id=None, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model.eval()


def _model(family: str):
    return _window_model() if family == "gpt_oss" else build_model(_conf(family))


def _engine(model, **kw) -> GenerationEngine:
    kw = {"block_size": 4, "max_num_tokens": 24, "max_num_seqs": 4, "progress": False, **kw}
    return GenerationEngine(swap_attention(model), **kw)


def test_ngram_draft_proposes_what_followed_the_latest_match():
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram_draft([1, 2, 3, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest occurrence
    assert ngram_draft([5, 6, 7], 4) == []  # no earlier occurrence
    assert ngram_draft([1, 2, 1], 4) == [2, 1]  # 1-gram fallback, cut at the end
    assert ngram_draft([1, 2, 1], 0) == []


@pytest.mark.parametrize(
    ("family", "k", "graphs"),
    [("llama", 4, False), ("deepseek_v3", 3, False), ("gpt_oss", 5, False),
     ("llama", 4, True), ("gpt_oss", 3, True)],
)  # fmt: skip
def test_greedy_speculation_equals_plain_decoding(family, k, graphs):
    # GQA, MLA, and a 6-token sliding window with sinks (k + 1 = 6 tokens verified at once);
    # graphs: verification on the static buffers of the CUDA-graph path (eager on CPU).
    engine = _engine(_model(family), decode_graphs=graphs)
    prompts = repeated_prompts()
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=14))
    spec = engine.generate(
        prompts,
        SamplingParams(max_new_tokens=14, speculative="ngram", num_speculative_tokens=k, **ALWAYS),
    )
    assert spec.outputs == plain.outputs
    s = spec.stats
    assert s.spec_steps > 0 and s.spec_rows >= s.spec_steps
    assert 0 < s.spec_accepted_tokens <= s.spec_draft_tokens
    assert s.spec_emitted_tokens == s.spec_rows + s.spec_accepted_tokens
    assert s.spec_draft_s > 0 and s.spec_verify_s > 0
    if family == "gpt_oss":
        # Windowed blocks per request at a verification: the run of W - 1 + k + 1 positions.
        vb = 4
        assert s.peak_window_blocks_per_decode[6] <= -(-(6 - 1 + k + 1 - 1) // vb) + 1


def test_device_greedy_acceptance_equals_the_host_rule():
    # Rows of 5 query tokens: a last token, 0..4 drafts that match the argmax for a while,
    # unused tokens at position -1 (their ids may equal the argmax: they must not count).
    g = torch.Generator().manual_seed(2)
    b, q, v = 40, 5, 7
    logits = torch.randn(b * q, v, generator=g)
    target = logits.argmax(-1).view(b, q)
    ids = torch.randint(0, v, (b, q), generator=g)
    positions = torch.full((b, q), -1)
    drafts = []
    for i in range(b):
        n, good = i % q, (i // q) % q  # n drafts, the first `good` of them right
        ids[i, 1 : 1 + n] = torch.where(
            torch.arange(n) < good, target[i, :n], (target[i, :n] + 1) % v
        )
        ids[i, 1 + n :] = target[i, n:-1] if n < q - 1 else ids[i, 1 + n :]
        positions[i, : n + 1] = torch.arange(n + 1) + 10
        drafts.append(ids[i, 1 : 1 + n].tolist())
    got = accept_greedy(logits, ids.flatten(), positions.flatten(), q)
    rows = torch.cat([torch.arange(i * q, i * q + len(d) + 1) for i, d in enumerate(drafts)])
    want = accept_drafts(logits[rows], drafts, None, SamplingParams())
    assert [[*d[:a], t[a]] for d, (a, *t) in zip(drafts, got.tolist())] == want
    assert torch.equal(got[:, 1:], target)
    assert {len(w) for w in want} == set(range(1, q + 1))  # every count of kept drafts


def test_graph_runs_end_when_a_request_finishes_and_admit_the_next():
    # Five prompts on two rows, a stop token: verification runs on the static buffers end
    # when a request stops (early or at its length), the next one is admitted and prefilled,
    # and the greedy tokens stay the plain ones.
    engine = _engine(_model("llama"), decode_graphs=True, max_num_seqs=2)
    prompts = repeated_prompts() + [repeated_prompts(5)[0]]
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = plain.outputs[1][4]
    params = SamplingParams(max_new_tokens=12, eos_token_id=stop)
    want = engine.generate(prompts, params)
    assert any(len(o) < 12 for o in want.outputs)
    spec = SamplingParams(max_new_tokens=12, eos_token_id=stop, speculative="ngram",
                          num_speculative_tokens=3, **ALWAYS)  # fmt: skip
    got = engine.generate(prompts, spec)
    assert got.outputs == want.outputs and got.finish_reasons == want.finish_reasons
    assert got.stats.spec_steps > 0 and got.stats.spec_accepted_tokens > 0


def test_sampled_verification_on_graph_buffers_draws_as_eager():
    # Sampling on the static-buffer path (the host reads the real rows' logits) draws the
    # same tokens as the eager verification with the same seed.
    model = _model("llama")
    prompts = repeated_prompts()
    greedy = _engine(model).generate(prompts, SamplingParams(max_new_tokens=10)).outputs
    drafter = ReplayDrafter([p + o for p, o in zip(prompts, greedy)], vocab_size=256)
    params = SamplingParams(max_new_tokens=10, temperature=0.5, top_k=3, seed=4,
                            speculative=drafter, num_speculative_tokens=3, **ALWAYS)  # fmt: skip
    runs = [_engine(model, decode_graphs=g).generate(prompts, params) for g in (False, True)]
    assert runs[0].outputs == runs[1].outputs
    assert runs[1].stats.spec_steps > 0 and runs[1].stats.spec_accepted_tokens > 0


def test_window_group_rollback_holds_what_plain_decoding_holds():
    # A verification prepares the blocks of c .. c + k; after acceptance the row must hold
    # exactly the blocks of a plain decode run to the same length (count them).
    window, bs, k = 6, 2, 5
    for accepted in range(k + 1):
        spec = WindowBlockGroup(window, num_blocks=32, block_size=bs, dcp_size=2,
                                max_num_seqs=1, max_model_len=64, max_num_tokens=8,
                                max_query_len=k + 1)  # fmt: skip
        plain = WindowBlockGroup(window, num_blocks=32, block_size=bs, dcp_size=2,
                                 max_num_seqs=1, max_model_len=64, max_num_tokens=8)  # fmt: skip
        for g in (spec, plain):
            assert g.admit(0, 10, 64)
            g.prepare(0, 0, 10)
            g.release(0, 10)
        c = 10
        spec.prepare(0, c, 1)  # what the scheduler's decode step asks for
        spec.prepare(0, c, k + 1, decode_threshold=k + 1)
        held = len(spec.blocks(0))
        end = c + 1 + accepted
        spec.release(0, end)
        freed = spec.rollback(0, end)
        for t in range(c, end):
            plain.prepare(0, t, 1)
            plain.release(0, t + 1)
        assert spec.blocks(0).keys() == plain.blocks(0).keys(), accepted
        assert spec.allocator.num_used == plain.allocator.num_used == len(plain.blocks(0))
        # What plain decoding holds: the entries of [first visible, end).
        vb = bs * 2
        first = window_first_visible(end, window)
        assert sorted(spec.blocks(0)) == list(range(first // vb, -(-end // vb)))
        assert held >= len(spec.blocks(0)) + len(freed) - 0
        assert all(int(spec.tensor[0, e]) == 0 for e in range(64 // vb) if e not in spec.blocks(0))


def _exact_joint(model, prompt, params, steps):
    """The target's exact distribution of its next ``steps`` tokens: {tuple: probability}."""
    from cp_modules.engine.sampling import token_probs

    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, pr in out.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1:]
            p = token_probs(logits.float(), params)[0]
            for t in p.nonzero().flatten().tolist():
                nxt[seq + (t,)] = pr * float(p[t])
        out = nxt
    return out


def _chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    # Cells with expected counts < 5 are pooled (so the chi-square approximation holds).
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    assert sum(counts.values()) == n and set(counts) <= set(probs)
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def test_sampled_speculation_keeps_the_target_distribution():
    # 800 requests of one prompt sample 3 tokens (temperature 1.5, top-k 3) with drafts of the
    # most likely path (kept with probability p, else resampled): the joint of the 27 paths
    # must be the target's exact one (chi-square at p = 1e-3), as for plain sampling.
    model = build_model(_conf("llama"))
    prompt = repeated_prompts()[0][:10]
    params = SamplingParams(max_new_tokens=3, temperature=1.5, top_k=3, seed=11)
    exact = _exact_joint(model, prompt, params, 3)
    greedy = list(max(exact, key=exact.get))
    n = 800
    engine = _engine(model, max_num_tokens=n * 4, max_num_seqs=n)
    drafter = ReplayDrafter([prompt + greedy] * n, vocab_size=256)
    for spec in (None, drafter):
        kw = {} if spec is None else dict(speculative=spec, num_speculative_tokens=2, **ALWAYS)
        res = engine.generate([prompt] * n, SamplingParams(**{**params.__dict__, **kw}))
        counts: dict = {}
        for o in res.outputs:
            counts[tuple(o)] = counts.get(tuple(o), 0) + 1
        stat, df = _chi_square(counts, exact, n)
        assert stat < chi2_critical(df), (spec is not None, stat, df)
        if spec is not None:
            s = res.stats
            assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # both outcomes happen


def test_rejection_rule_with_a_draft_distribution_keeps_the_target_one():
    # Drafts drawn from a q unlike p: the first verified token is distributed as p_0, and the
    # second (after an accepted first draft) as p_1.
    g = torch.Generator().manual_seed(5)
    v, n = 5, 6000
    p_logits = torch.randn(3, v, generator=g) * 1.5
    q = torch.softmax(torch.randn(2, v, generator=g), -1)
    d = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, 2] drafts ~ q
    params = SamplingParams(temperature=1.0)
    logits = p_logits.repeat(n, 1)
    out = accept_drafts(logits, d.tolist(), [q] * n, params, g)
    p = torch.softmax(p_logits, -1)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=v)
    stat = float(((first - n * p[0]) ** 2 / (n * p[0])).sum())
    assert stat < chi2_critical(v - 1), stat
    # Second token: among the runs whose first draft was kept (its row is p_1).
    second = [o[1] for o, dd in zip(out, d.tolist()) if len(o) > 1 and o[0] == dd[0]]
    m = len(second)
    assert m > 500
    cnt = torch.bincount(torch.tensor(second), minlength=v)
    stat = float(((cnt - m * p[1]) ** 2 / (m * p[1])).sum())
    assert stat < chi2_critical(v - 1), stat
    assert all(1 <= len(o) <= 3 for o in out)


def test_a_draft_model_drafts_through_the_same_interface():
    # A draft model with other weights (same vocabulary): greedy tokens are the plain ones.
    engine = _engine(build_model(_conf("llama")))
    prompts = repeated_prompts()
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=10)).outputs
    drafter = DraftModelDrafter(build_model(_conf("llama", seed=1)))
    res = engine.generate(
        prompts,
        SamplingParams(max_new_tokens=10, speculative=drafter, num_speculative_tokens=3, **ALWAYS),
    )
    assert res.outputs == plain
    assert res.stats.spec_draft_tokens > 0
    # The target itself (unswapped copy) as the draft: every draft is accepted.
    same = DraftModelDrafter(build_model(_conf("llama")))
    res = engine.generate(
        prompts,
        SamplingParams(max_new_tokens=10, speculative=same, num_speculative_tokens=3, **ALWAYS),
    )
    assert res.outputs == plain
    assert res.stats.spec_accepted_tokens == res.stats.spec_draft_tokens > 0


def test_bad_speculative_options_are_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="eagle", num_speculative_tokens=2)
    engine = _engine(build_model(_conf("llama")), max_num_tokens=8)
    with pytest.raises(ValueError, match="num_speculative_tokens=8"):
        engine.generate([[1, 2]], SamplingParams(speculative="ngram", num_speculative_tokens=8))
    other = DraftModelDrafter(build_model(ModelConf(family=Family.llama, num_kv_heads=2,
                                                    vocab_size=128)))  # fmt: skip
    with pytest.raises(ValueError, match="speculative: the draft model's vocab_size=128"):
        engine.generate([[1, 2]], SamplingParams(speculative=other, num_speculative_tokens=2))


def test_a_verification_step_that_cannot_be_captured_is_refused_when_graphs_are_required(
    monkeypatch,
):
    # CPU cannot capture: a capture failure is simulated where the verification graph is built.
    import cp_modules.engine.verification as spec

    def fail(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(spec, "DecodeGraph", fail)
    params = SamplingParams(
        max_new_tokens=4, speculative="ngram", num_speculative_tokens=2, **ALWAYS
    )
    engine = _engine(build_model(_conf("llama")), decode_graphs=True)
    with pytest.raises(ValueError, match="speculative='ngram' with decode_graphs=True"):
        engine.generate([[1, 2, 1, 2]], params)
    # decode_graphs=None: a warning, then eager verification with the same tokens.
    engine = _engine(build_model(_conf("llama")), decode_graphs=None)
    engine.decode_graphs = True  # as on CUDA
    with pytest.warns(UserWarning, match="verification steps run eagerly"):
        got = engine.generate([[1, 2, 1, 2]], params).outputs
    assert got == engine.generate([[1, 2, 1, 2]], SamplingParams(max_new_tokens=4)).outputs


def test_backoff_pauses_speculation_while_it_does_not_pay():
    b = SpeculationBackoff(0.25)
    assert b.speculate() and not b.record(0, 4)  # one step is not yet a judgement
    assert b.record(0, 4) and b.plain_left == 8 and not b.speculate()
    b.ran_plain(5)
    assert b.plain_left == 3 and not b.speculate()
    b.ran_plain(3)
    assert b.speculate()
    assert not b.record(0, 4) and b.record(1, 4) and b.plain_left == 16  # failed again: longer
    b.ran_plain(16)
    assert not b.record(4, 4) and not b.record(4, 4)  # a probe that pays resets the pause
    assert not b.record(0, 4) and b.record(0, 4) and b.plain_left == 8
    for _ in range(10):
        b.ran_plain(b.plain_left)
        b.record(0, 4)
        b.record(0, 4)
    assert b.plain_left == SpeculationBackoff.LONGEST
    off = SpeculationBackoff(0)
    assert not any(off.record(0, 4) for _ in range(5)) and off.speculate()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-buffers"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"], ids=["gqa", "window-sinks"])
def test_rejected_drafts_back_off_to_plain_steps_with_plain_tokens(family, graphs):
    # Drafts that are always wrong: with the default back-off most decode steps run without
    # drafts; with speculative_min_accepted=0 every decode step verifies. Greedy tokens are
    # plain decoding's either way (window groups switch between the two kinds of step).
    model = _model(family)
    prompts = repeated_prompts()
    engine = _engine(model, decode_graphs=graphs)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    wrong = ReplayDrafter([p + o for p, o in zip(prompts, plain.outputs)], 256, offset=1)
    runs = {}
    for m in (0.25, 0):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, speculative=wrong,
                                num_speculative_tokens=3, speculative_min_accepted=m)  # fmt: skip
        runs[m] = engine.generate(prompts, params)
        assert runs[m].outputs == plain.outputs
    assert runs[0].stats.spec_steps == 30 - 1  # every decode step (the first token: prefill)
    assert 0 < runs[0.25].stats.spec_steps <= 8 and runs[0.25].stats.spec_accepted_tokens == 0
    assert runs[0.25].stats.num_steps > runs[0.25].stats.spec_steps


def test_backoff_option_is_checked():
    for bad in (-0.5, float("nan"), float("inf"), True, "0.2"):
        with pytest.raises(ValueError, match="speculative_min_accepted must be"):
            SamplingParams(speculative="ngram", num_speculative_tokens=2,
                           speculative_min_accepted=bad)  # fmt: skip

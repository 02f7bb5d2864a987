"""Sliding-window layer groups keep a bounded KV cache: their blocks go back to the pool once
every query to come is past them, so a request holds at most ceil(W / (block_size * dcp)) + 1
blocks of a windowed layer at a decode step however long it grows, while greedy tokens stay
those of HF ``generate``.

Unit tests drive the scheduler and the step metadata on every DCP rank of a layout at once
(host values only): each cache slot records which token was written there, so every write,
prefix read and decode read of the windowed group is checked position by position. The model
tests run the engine on one process and on gloo ranks (pcp2 x dcp2, interleave 2)."""

from __future__ import annotations

import math

import pytest
import torch

from cp_modules.cache.dcp import dcp_num_blocks, dcp_rank_of
from cp_modules.cache.window import (
    blocks_spanned,
    window_block_bound,
    window_first_visible,
    window_write_start,
)
from cp_modules.config import ParallelConfig
from cp_modules.distributed.dcp_spec import DCPCommSpec
from cp_modules.engine import Request, Scheduler
from cp_modules.step import CPRuntime, build_step_metadata
from cp_modules.testing import hf_greedy_tokens, run_distributed

WINDOW = 8
BLOCK = 4
LONG_PROMPTS = (40, 13)
LONG_NEW = 200
CHUNK_NEW = 24
FAMILIES = ("gemma3", "gpt_oss")


def _bound(window: int, dcp: int) -> int:
    return math.ceil(window / (BLOCK * dcp)) + 1


# ----------------------------------------------------------------------------- the rule


def test_the_freeing_rule_and_the_bounds():
    assert window_first_visible(10, 4) == 7 and window_first_visible(2, 4) == 0
    assert window_first_visible(5, 1) == 5
    # A chunk [10, 20) under W = 4 keeps its last 3 tokens; a decode keeps its token.
    assert window_write_start(10, 10, 4) == 17 and window_write_start(10, 1, 4) == 10
    assert window_write_start(10, 2, 8) == 10
    # A decode keeps its token even when no later query sees it (it reads it itself).
    assert window_write_start(10, 1, 1) == 10 and window_write_start(10, 2, 1) == 12
    assert window_write_start(0, 1, 1) == 1  # a one-token prompt attends from the step
    for vb in (1, 3, 4, 8):
        for length in range(0, 30):
            worst = max(
                (len({p // vb for p in range(o, o + length)}) for o in range(vb)), default=0
            )
            assert blocks_spanned(length, vb) == worst, (vb, length)
    for w in (1, 2, 5, 8, 16, 33):
        for dcp in (1, 2, 4):
            assert window_block_bound(w, BLOCK, dcp, 1) <= _bound(w, dcp), (w, dcp)


def _runtime(dcp: int, rank: int, interleave: int) -> CPRuntime:
    config = ParallelConfig(
        tensor_parallel_size=dcp,
        decode_context_parallel_size=dcp,
        dcp_kv_cache_interleave_size=interleave,
    )
    if dcp == 1:
        return CPRuntime(config=config)
    spec = DCPCommSpec("dcp", dcp, rank, "tp", 1, 0, "all_reduce", False, (0,) * dcp)
    return CPRuntime(config=config, dcp=spec)


def _simulate(dcp, interleave, window, budget, lens=(23, 9, 2, 17), max_new=12):
    """Run a scheduler with one windowed group on every DCP rank's metadata; check each read."""
    reqs = [Request(i, list(range(n)), max_new) for i, n in enumerate(lens)]
    sched = Scheduler(
        reqs, num_blocks=64, block_size=BLOCK, dcp_size=dcp, max_num_tokens=budget,
        max_num_seqs=2, window_num_blocks={window: 12},
    )  # fmt: skip
    group = sched.window_groups[window]
    runtimes = [_runtime(dcp, r, interleave) for r in range(dcp)]
    # Each rank's windowed cache: slot -> code of the token written there (-1: never written).
    caches = [torch.full((12 * BLOCK,), -1, dtype=torch.long) for _ in range(dcp)]
    held = {"decode": 0, "prefill": 0}
    while not sched.done:
        b = sched.schedule()
        metas = [
            build_step_metadata(rt, b.num_new, b.num_computed, block_table=b.block_table,
                                window_block_tables=b.window_block_tables, block_size=BLOCK,
                                check_consistency=False).for_window(window)
            for rt in runtimes
        ]  # fmt: skip
        phase = "decode" if all(r.is_decoding for r in b.requests) else "prefill"
        for r in b.requests:
            held[phase] = max(held[phase], len(group.blocks(r.row)))
            assert len(group.blocks(r.row)) <= group.capacity(len(r.prompt), r.max_len)
        codes = torch.tensor(
            [r.index * 1000 + p for r, c, n in zip(b.requests, b.num_computed, b.num_new)
             for p in range(c, c + n)]
        )  # fmt: skip
        positions = codes % 1000
        for rank, m in enumerate(metas):
            # Writes: exactly the kept tokens this rank stores.
            keep = torch.cat([torch.arange(c, c + n) >= int(window_write_start(c, n, window))
                              for c, n in zip(b.num_computed, b.num_new)])  # fmt: skip
            mine = dcp_rank_of(positions, dcp, interleave) == rank
            assert torch.equal(m.slot_mapping >= 0, keep & mine)
            caches[rank][m.slot_mapping[m.slot_mapping >= 0]] = codes[m.slot_mapping >= 0]
        # Cached prefix of prompt chunks: the window before the chunk, gathered over DCP.
        m0 = metas[0]
        want = [r.index * 1000 + p for r, c, n in zip(b.requests, b.num_computed, b.num_new)
                if not (n == 1 and c > 0) for p in range(max(0, c - window + 1), c)]  # fmt: skip
        assert m0.has_prefix == bool(want)
        if want:
            gathered = torch.cat([caches[r][m.prefix_read_slots] for r, m in enumerate(metas)])
            assert gathered[m0.prefix_gather_index].tolist() == want
            assert all(torch.equal(m.prefix_gather_index, m0.prefix_gather_index) for m in metas)
        # Decode queries: each rank's local keys from the window start to the query.
        for rank, m in enumerate(metas):
            start, length = m.decode_kv_start(window), m.decode_kv_len
            for t in range(m.decode_seq_idx.numel()):
                row, p = int(m.decode_seq_idx[t]), int(m.decode_positions[t])
                req = b.requests[row]
                j = torch.arange(int(start[t]), int(length[t]))
                slots = m.block_table[row, j // BLOCK].long() * BLOCK + j % BLOCK
                seen = range(max(0, p - window + 1), p + 1)
                want_d = [req.index * 1000 + q for q in seen
                          if dcp_rank_of(q, dcp, interleave) == rank]  # fmt: skip
                assert caches[rank][slots].tolist() == want_d, (rank, p)
        sched.update(b, [7] * len(b.sample_requests), frozenset(), 0.0)
    assert group.allocator.num_used == 0 and sched.allocator.num_used == 0
    return held, group


@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("window", [1, 5, 8, 13])
@pytest.mark.parametrize("budget", [3, 7, 64])
def test_windowed_group_writes_and_reads_exactly_its_window(dcp, interleave, window, budget):
    held, group = _simulate(dcp, interleave, window, budget)
    assert held["decode"] <= _bound(window, dcp)
    assert group.peak_blocks_per_request == max(held.values())


def test_blocks_are_freed_as_the_window_moves():
    req = Request(0, list(range(10)), 30)
    sched = Scheduler([req], num_blocks=20, block_size=4, dcp_size=1, max_num_tokens=16,
                      max_num_seqs=1, window_num_blocks={6: 4})  # fmt: skip
    g = sched.window_groups[6]
    b = sched.schedule()
    # The prompt [0, 10) keeps 5 tokens [5, 10): entries 1 and 2 (positions 4..11).
    assert sorted(g.blocks(0)) == [1, 2] and b.window_block_tables[6][0, 0] == 0
    sched.update(b, [7], frozenset(), 0.0)  # next query at 10 sees [5, 10]
    assert sorted(g.blocks(0)) == [1, 2]
    for _ in range(3):  # positions 10, 11, 12 decoded: the next query (13) sees [8, 13]
        sched.update(sched.schedule(), [7], frozenset(), 0.0)
    assert sorted(g.blocks(0)) == [2, 3]
    table = sched.schedule().window_block_tables[6][0]
    assert table[1] == 0 and table[2] != table[3]
    # The full layers' table keeps the whole request.
    assert len(sched.table.blocks(0)) == dcp_num_blocks(40, 4)


def test_a_step_without_window_tables_is_the_one_layout_of_every_layer():
    rt = CPRuntime.single()
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = build_step_metadata(rt, [3, 1], [5, 7], block_table=bt, block_size=4)
    assert meta.for_window(4) is meta and meta.for_window(None) is meta
    # A window that spans every request keeps and reads what the full layers do.
    grouped = build_step_metadata(rt, [3, 1], [5, 7], block_table=bt, block_size=4,
                                  window_block_tables={64: bt})  # fmt: skip
    view = grouped.for_window(64)
    assert view is not grouped and grouped.for_window(4) is grouped
    for name in ("slot_mapping", "prefix_read_slots", "prefix_gather_index", "prefix_cu_seqlens"):
        assert torch.equal(getattr(view, name), getattr(meta, name)), name
    with pytest.raises(ValueError, match="window_block_tables keys"):
        build_step_metadata(rt, [3], [5], block_table=bt[:1], window_block_tables={0: bt[:1]})
    with pytest.raises(ValueError, match="window_block_tables\\[4\\] has 1 blocks"):
        build_step_metadata(rt, [3], [5], block_table=bt[:1], block_size=4,
                            window_block_tables={4: bt[:1, :1]})  # fmt: skip


# ----------------------------------------------------------------------------- models


def _model(family: str, window: int = WINDOW):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                  layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)  # fmt: skip
    if family == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common)).eval()
    model = tf.GptOssForCausalLM(
        tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model.eval()


def _prompts(lens=LONG_PROMPTS) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def _hf_generate(family: str, max_new: int) -> list[list[int]]:
    return hf_greedy_tokens(_model(family), _prompts(), max_new)


def _generate(groups, family: str, max_num_tokens: int, max_new: int, graphs: bool = False):
    from cp_modules.engine import GenerationEngine, SamplingParams
    from cp_modules.modules.hf_swap import swap_attention

    model = swap_attention(_model(family), groups)
    engine = GenerationEngine(
        model, groups, block_size=BLOCK, max_num_tokens=max_num_tokens, progress=False,
        decode_graphs=graphs,
    )  # fmt: skip
    res = engine.generate(_prompts(), SamplingParams(max_new_tokens=max_new))
    s = res.stats
    per_request = (s.peak_window_blocks_per_request, s.peak_window_blocks_per_decode)
    return res.outputs, s.peak_blocks, s.peak_window_blocks, per_request


def _cases():
    # (family, step budget, new tokens): a long generation, then chunked prompts (chunks shorter
    # than the window and longer than it) against the one-shot prompt.
    # The last two decode on the engine's static buffers (the CUDA-graph code path, eager here):
    # the window tables move every step.
    return (
        [("gemma3", 64, LONG_NEW, False)]
        + [("gpt_oss", budget, CHUNK_NEW, False) for budget in (64, 5, 11)]
        + [("gemma3", 64, LONG_NEW, True), ("gpt_oss", 5, CHUNK_NEW, True)]
    )


def _rank_body(rank: int, world_size: int):
    from cp_modules.distributed.groups import init_cp_groups

    torch.set_num_threads(1)
    config = ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2,
                            dcp_kv_cache_interleave_size=2)  # fmt: skip
    groups = init_cp_groups(config)
    return [_generate(groups, *case) for case in _cases()]


def _check(results, dcp: int, want: dict):
    for (family, budget, new, graphs), (outputs, full, pool, (any_step, decode)) in zip(
        _cases(), results
    ):
        where = (family, budget, dcp, graphs, any_step, decode)
        assert outputs == want[family, new], where
        # A request's windowed blocks stay bounded at every decode step; prompt chunks may hold
        # the window before the chunk and the tokens it keeps.
        assert decode[WINDOW] <= _bound(WINDOW, dcp), where
        assert any_step[WINDOW] <= window_block_bound(WINDOW, BLOCK, dcp, budget), where
        if new == LONG_NEW:
            # One-shot prompts: the decode bound holds at every step; the full layers grow.
            assert any_step[WINDOW] <= _bound(WINDOW, dcp), where
            longest = LONG_PROMPTS[0] + LONG_NEW
            assert full >= dcp_num_blocks(longest, BLOCK, dcp) > 4 * _bound(WINDOW, dcp)
            assert pool[WINDOW] <= len(LONG_PROMPTS) * _bound(WINDOW, dcp)


@pytest.fixture(scope="module")
def hf_reference():
    return {(f, n): _hf_generate(f, n) for f, n in {(c[0], c[2]) for c in _cases()}}


def test_long_windowed_generation_keeps_a_bounded_cache_on_one_process(hf_reference):
    torch.set_num_threads(1)
    _check([_generate(None, *case) for case in _cases()], 1, hf_reference)


@pytest.mark.distributed
def test_long_windowed_generation_keeps_a_bounded_cache_at_pcp2_dcp2(hf_reference):
    results = run_distributed(_rank_body, 2, timeout_s=600)
    for per_rank in results:
        _check(per_rank, 2, hf_reference)


def test_a_call_with_another_window_than_its_cache_layout_is_refused():
    from cp_modules.modules.hf_swap import allocate_kv_caches, cp_attention_layers, swap_attention

    model = swap_attention(_model("gemma3"))
    allocate_kv_caches(model, 8, BLOCK, dtype=torch.float32)
    binding = cp_attention_layers(model)[0].cp_binding
    assert binding.sliding_window == WINDOW
    assert cp_attention_layers(model)[1].cp_binding.sliding_window is None
    binding.sliding_window = WINDOW + 1
    from cp_modules.step import cp_step

    meta = build_step_metadata(
        CPRuntime.single(), [5], block_table=torch.zeros(1, 2, dtype=torch.int32), block_size=4
    )
    with torch.no_grad(), cp_step(meta), pytest.raises(ValueError, match="laid out for window=9"):
        model(input_ids=torch.arange(5)[None], position_ids=torch.arange(5)[None], use_cache=False)

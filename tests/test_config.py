"""ParallelConfig validation: every rule, both sides of each boundary."""

import warnings

import pytest

import cp_modules.config as config_mod
from cp_modules import ParallelConfig
from cp_modules.config import valid_dcp_sizes


class TestCommBackend:
    def test_default_is_ag_rs(self):
        assert ParallelConfig().dcp_comm_backend == "ag_rs"

    def test_a2a_requires_dcp_greater_than_1(self):
        with pytest.raises(ValueError, match="requires decode_context_parallel_size > 1"):
            ParallelConfig(dcp_comm_backend="a2a", decode_context_parallel_size=1)

    def test_a2a_with_dcp_valid(self):
        cfg = ParallelConfig(
            dcp_comm_backend="a2a", tensor_parallel_size=8, decode_context_parallel_size=4
        )
        assert cfg.dcp_comm_backend == "a2a"

    def test_a2a_at_boundary_dcp_2(self):
        cfg = ParallelConfig(
            dcp_comm_backend="a2a", tensor_parallel_size=2, decode_context_parallel_size=2
        )
        assert cfg.dcp == 2

    @pytest.mark.parametrize("backend", ["invalid", "AG_RS", "", "a2a_packed"])
    def test_invalid_backend_rejected(self, backend):
        with pytest.raises(ValueError, match=r"dcp_comm_backend must be one of \['ag_rs', 'a2a'\]"):
            ParallelConfig(dcp_comm_backend=backend)

    def test_ag_rs_with_dcp_1_valid(self):
        assert ParallelConfig(dcp_comm_backend="ag_rs").dcp == 1


class TestSizes:
    @pytest.mark.parametrize(
        "field",
        [
            "tensor_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "pipeline_parallel_size",
            "dcp_kv_cache_interleave_size",
        ],
    )
    @pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
    def test_sizes_must_be_positive_ints(self, field, value):
        with pytest.raises(ValueError, match=field):
            ParallelConfig(**{field: value})

    @pytest.mark.parametrize(
        "field",
        [
            "tensor_parallel_size",
            "data_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "dcp_kv_cache_interleave_size",
        ],
    )
    def test_size_one_is_valid(self, field):
        ParallelConfig(**{field: 1})

    def test_world_size(self):
        cfg = ParallelConfig(
            tensor_parallel_size=4,
            prefill_context_parallel_size=2,
            decode_context_parallel_size=4,
            data_parallel_size=3,
            pipeline_parallel_size=2,
        )
        assert cfg.world_size == 48  # dcp adds no ranks


class TestDcpRules:
    @pytest.mark.parametrize("tp,dcp", [(4, 1), (4, 2), (4, 4), (8, 8), (6, 3), (1, 1)])
    def test_pcp1_dcp_divides_tp(self, tp, dcp):
        assert ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).dcp == dcp

    @pytest.mark.parametrize("tp,dcp", [(4, 3), (4, 8), (6, 4), (1, 2)])
    def test_pcp1_dcp_not_dividing_tp_rejected(self, tp, dcp):
        with pytest.raises(
            ValueError,
            match=rf"decode_context_parallel_size={dcp} .*must divide tensor_parallel_size={tp}",
        ):
            ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)

    @pytest.mark.parametrize(
        "tp,pcp,dcp",
        [
            (2, 2, 2),  # dcp == pcp
            (2, 2, 4),  # dcp == tp*pcp
            (4, 2, 4),  # partial-TP: pcp < dcp < tp*pcp
            (4, 2, 8),
            (4, 2, 2),
            (1, 4, 4),
            (2, 2, 1),  # no DCP
            (1, 8, 8),
        ],
    )
    def test_pcp_dcp_accepted(self, tp, pcp, dcp):
        cfg = ParallelConfig(
            tensor_parallel_size=tp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
        )
        assert cfg.tp_positions_per_dcp_group == max(1, dcp // pcp)

    @pytest.mark.parametrize(
        "tp,pcp,dcp",
        [(2, 2, 3), (4, 2, 6), (2, 4, 2), (4, 2, 16), (2, 2, 8), (1, 2, 4), (3, 2, 4)],
    )
    def test_pcp_dcp_rejected(self, tp, pcp, dcp):
        with pytest.raises(ValueError, match=r"valid values: \[1, "):
            ParallelConfig(
                tensor_parallel_size=tp,
                prefill_context_parallel_size=pcp,
                decode_context_parallel_size=dcp,
            )

    def test_valid_dcp_sizes(self):
        assert valid_dcp_sizes(4, 1) == [1, 2, 4]
        assert valid_dcp_sizes(4, 2) == [1, 2, 4, 8]
        assert valid_dcp_sizes(2, 4) == [1, 4, 8]
        assert valid_dcp_sizes(1, 1) == [1]


class TestInterleave:
    def test_default(self):
        assert ParallelConfig().dcp_kv_cache_interleave_size == 1

    @pytest.mark.parametrize("block,inter", [(16, 1), (16, 16), (16, 8), (64, 16)])
    def test_block_size_ok(self, block, inter):
        ParallelConfig(dcp_kv_cache_interleave_size=inter).validate_block_size(block)

    @pytest.mark.parametrize("block,inter", [(16, 32), (16, 3), (64, 24), (16, 17)])
    def test_block_size_rejected(self, block, inter):
        with pytest.raises(
            ValueError, match=rf"dcp_kv_cache_interleave_size={inter} must be <= block_size={block}"
        ):
            ParallelConfig(dcp_kv_cache_interleave_size=inter).validate_block_size(block)

    @pytest.mark.parametrize("block", [0, -16])
    def test_block_size_must_be_positive(self, block):
        with pytest.raises(ValueError, match="block_size"):
            ParallelConfig().validate_block_size(block)

    def test_deprecated_alias_moves_and_warns_once(self, monkeypatch):
        monkeypatch.setattr(config_mod, "_warned_deprecated_interleave", False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = ParallelConfig(cp_kv_cache_interleave_size=16)
            b = ParallelConfig(cp_kv_cache_interleave_size=8)
        assert a.dcp_kv_cache_interleave_size == 16 and a.cp_kv_cache_interleave_size is None
        assert b.dcp_kv_cache_interleave_size == 8
        dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(dep) == 1 and "dcp_kv_cache_interleave_size" in str(dep[0].message)

    def test_deprecated_alias_same_value_ok(self):
        cfg = ParallelConfig(cp_kv_cache_interleave_size=4, dcp_kv_cache_interleave_size=4)
        assert cfg.dcp_kv_cache_interleave_size == 4

    def test_deprecated_alias_conflict_rejected(self):
        with pytest.raises(ValueError, match="conflicts with dcp_kv_cache_interleave_size=8"):
            ParallelConfig(cp_kv_cache_interleave_size=4, dcp_kv_cache_interleave_size=8)

    def test_deprecated_alias_validated(self):
        with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
            ParallelConfig(cp_kv_cache_interleave_size=0)


class TestHeads:
    def test_query_heads_divisible_by_tp(self):
        ParallelConfig(tensor_parallel_size=4).validate_heads(32, 8)
        with pytest.raises(
            ValueError, match=r"num_heads=30 must be divisible by tensor_parallel_size=4"
        ):
            ParallelConfig(tensor_parallel_size=4).validate_heads(30, 2)

    def test_kv_heads_and_tp_divide(self):
        ParallelConfig(tensor_parallel_size=4).validate_heads(32, 2)  # replicated kv heads
        ParallelConfig(tensor_parallel_size=4).validate_heads(32, 4)
        with pytest.raises(ValueError, match="num_kv_heads=6 and tensor_parallel_size=4"):
            ParallelConfig(tensor_parallel_size=4).validate_heads(36, 6)

    def test_heads_multiple_of_kv_heads(self):
        with pytest.raises(ValueError, match="must be a multiple of num_kv_heads=3"):
            ParallelConfig().validate_heads(8, 3)

    @pytest.mark.parametrize(
        "tp,pcp,dcp,kv,ok",
        [
            # pcp=1: DCP group of dcp TP positions must share one KV head: dcp <= tp/kv.
            (4, 1, 4, 1, True),
            (4, 1, 4, 2, False),
            (4, 1, 2, 2, True),  # boundary: dcp == tp/kv
            (4, 1, 2, 4, False),  # kv == tp: every TP position has its own KV head
            (8, 1, 4, 2, True),
            (8, 1, 8, 2, False),
            (6, 1, 2, 2, False),  # tp/kv = 3 is not a multiple of 2: group {2,3} spans two heads
            (6, 1, 3, 2, True),
            # dcp == pcp: peers hold the same TP position, any kv count works.
            (2, 2, 2, 2, True),
            (4, 2, 2, 8, True),
            # partial-TP with pcp: dcp/pcp TP positions per group.
            (4, 2, 4, 2, True),
            (4, 2, 4, 4, False),
            (2, 2, 4, 1, True),
            (2, 2, 4, 2, False),
        ],
    )
    def test_dcp_group_must_share_kv_heads(self, tp, pcp, dcp, kv, ok):
        cfg = ParallelConfig(
            tensor_parallel_size=tp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
        )
        heads = 24 if tp == 6 else 32
        if ok:
            cfg.validate_heads(heads, kv)
        else:
            with pytest.raises(
                ValueError, match="All ranks of a DCP group must hold the same KV heads"
            ):
                cfg.validate_heads(heads, kv)

    def test_mla_always_shares_the_latent(self):
        ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8).validate_heads(
            128, None
        )

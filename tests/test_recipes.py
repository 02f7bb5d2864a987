"""Hydra recipes: every config file composes onto its typed schema; the recipes run end to end.

Composition uses Hydra's compose API (``initialize_config_dir``) with the schemas registered
in the ConfigStore, then :func:`load_config` builds the validated dataclasses. The generate
recipe runs as a subprocess: the README's main job (SmolLM2-135M-Instruct on 2 CPU ranks,
pcp=2 / dcp=2) and a tiny random model on 4 (tp=2, pcp=2, dcp=2); both must report greedy
tokens identical to one process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from recipe_configs import (
    BackendConf,
    BenchmarkConf,
    BenchmarkWorkload,
    GenerateConf,
    GenerateWorkload,
    ModelConf,
    load_config,
    register_configs,
)

from cp_modules.config import ParallelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
RECIPES = {
    "generate": (GenerateConf, GenerateWorkload),
    "benchmark": (BenchmarkConf, BenchmarkWorkload),
}
SHARED_GROUPS = {"parallel": ParallelConfig, "model": ModelConf, "backend": BackendConf}


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_config_file_composes_onto_its_schema():
    covered = set()
    for recipe, (schema, workload_type) in RECIPES.items():
        covered.add(CONF / f"{recipe}.yaml")
        conf = load_config(_compose(recipe, []), schema)
        assert isinstance(conf, schema) and isinstance(conf.workload, workload_type)
        for group, group_type in SHARED_GROUPS.items():
            for option in _options(group):
                conf = load_config(_compose(recipe, [f"{group}={option}"]), schema)
                assert isinstance(getattr(conf, group), group_type)
                covered.add(CONF / group / f"{option}.yaml")
        for option in _options(f"workload/{recipe}"):
            conf = load_config(_compose(recipe, [f"workload/{recipe}@workload={option}"]), schema)
            assert isinstance(conf.workload, workload_type)
            covered.add(CONF / "workload" / recipe / f"{option}.yaml")
    ours = [p for p in CONF.rglob("*.yaml") if p.parent.name in (*SHARED_GROUPS, *RECIPES)]
    assert set(ours) <= covered, sorted(set(ours) - covered)
    assert len(covered) >= 2 + 5 + 4 + 2 + 3 + 2


def test_composed_values_reach_the_objects():
    conf = load_config(
        _compose(
            "generate",
            ["parallel=tp2_pcp2_dcp4_a2a", "model=deepseek_v3_tiny", "workload.max_new_tokens=3"],
        ),
        GenerateConf,
    )
    pc = conf.parallel  # Hydra composes the library's ParallelConfig itself
    assert isinstance(pc, ParallelConfig)
    assert (pc.tp, pc.pcp, pc.dcp, pc.dcp_comm_backend) == (2, 2, 4, "a2a")
    assert conf.parallel.world_size == 4
    assert conf.model.family.value == "deepseek_v3" and conf.model.q_lora_rank == 32
    assert conf.workload.max_new_tokens == 3 and conf.backend.num_threads == 1


@pytest.mark.parametrize(
    "override, match",
    [
        ("parallel.decode_context_parallel_size=3", "decode_context_parallel_size=3"),
        ("parallel.dcp_comm_backend=nccl", r"dcp_comm_backend must be one of \['ag_rs', 'a2a'\]"),
        ("model.dtype=float8", "model.dtype must be one of"),
        ("workload.max_num_tokens=2", "workload.max_num_tokens=2"),
        ("backend.dist_backend=mpi", "backend.dist_backend must be one of"),
        ("workload.speculative=eagle", "workload: speculative must be None, 'ngram'"),
        ("workload.num_speculative_tokens=2", "workload: num_speculative_tokens=2 needs a drafter"),
        ("workload.speculative_min_accepted=-1", "workload: speculative_min_accepted must be"),
        ("backend.kv_cache_fp8_recent=4", "backend.kv_cache_fp8_recent=4 keeps tokens of an fp8"),
        ("backend.kv_cache_fp8_sink=-1", "backend.kv_cache_fp8_sink must be an integer >= 0"),
    ],
)
def test_invalid_values_are_value_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(_compose("generate", [override]), GenerateConf)


def test_wrong_types_and_enum_values_are_refused_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose("generate", ["parallel.tensor_parallel_size=two"])
    with pytest.raises(ConfigCompositionException):
        _compose("generate", ["workload.max_new_tokens=many"])
    with pytest.raises(ConfigCompositionException):
        _compose("generate", ["workload.no_such_field=1"])


def _run(recipe: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # The recipe (and its spawned ranks) import this checkout's package.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.distributed
def test_the_readme_main_job_generates_real_text_and_matches_one_process():
    r = _run("generate", "workload.progress=false")  # .venv/bin/python recipes/generate.py
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (float32) on 2 rank(s): tp=1 pcp=2 dcp=2" in r.stdout
    assert (
        r"<|im_start|>user\nWhat is the capital of France?<|im_end|>" in r.stdout
    )  # the chat template (repr)
    assert "'The capital of France is Paris.<|im_end|>'" in r.stdout
    assert "OK: greedy tokens identical to single-process generation (2 prompts)" in r.stdout
    assert (
        "tok/s" in r.stdout
        and "time to first token" in r.stdout
        and "KV cache per rank" in r.stdout
    )


@pytest.mark.distributed
def test_generate_recipe_runs_a_checkpoint_on_four_cpu_ranks_and_matches_one_process(tmp_path):
    """``model.checkpoint`` goes through ``load_pretrained``: at tp=2 each rank reads its shard
    of the safetensors files (the one-process reference loads them with from_pretrained)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "llama"))
    r = _run(
        "generate",
        "model=llama_tiny",
        f"model.checkpoint={tmp_path / 'llama'}",
        "model.dtype=float32",
        "parallel=tp2_pcp2_dcp2",
        "workload/generate@workload=tiny",
        "workload.prompt_lens=[21,6,2]",
        "workload.max_new_tokens=5",
        "workload.progress=false",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 4 rank(s): tp=2 pcp=2 dcp=2" in r.stdout
    assert "OK: greedy tokens identical to single-process generation (3 prompts)" in r.stdout
    assert "tok/s" in r.stdout and "time to first token" in r.stdout


def _generate_pcp2_dcp2(*overrides: str) -> subprocess.CompletedProcess:
    """The generate recipe on PCP 2 x DCP 2 (llama_tiny), checked against one process."""
    r = _run("generate", "model=llama_tiny", "parallel=pcp2_dcp2", "workload.progress=false",
             *overrides)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: greedy tokens identical to single-process generation" in r.stdout
    return r


@pytest.mark.distributed
def test_generate_recipe_speculates_on_two_cpu_ranks_and_matches_one_process():
    r = _generate_pcp2_dcp2(
        "workload/generate@workload=repeat",
        "workload.max_new_tokens=6",
        "workload.speculative_min_accepted=0",  # a random tiny model accepts few drafts
    )
    assert "speculative decoding: " in r.stdout and "verification steps" in r.stdout


@pytest.mark.distributed
def test_generate_recipe_fp8_window_on_two_cpu_ranks_matches_one_process():
    # fp8 KV with the bf16 window (sink and newest tokens).
    r = _generate_pcp2_dcp2(
        "workload.max_new_tokens=6",
        "backend.kv_cache_dtype=fp8_e4m3",
        "backend.kv_cache_fp8_sink=1",
        "backend.kv_cache_fp8_recent=4",
    )
    assert "bf16 window: sink 1, newest 4" in r.stdout


def test_generate_recipe_exits_non_zero_on_a_bad_config():
    r = _run("generate", "parallel.decode_context_parallel_size=3")
    assert r.returncode != 0
    assert "decode_context_parallel_size=3" in r.stdout + r.stderr


def test_benchmark_recipe_runs_on_cpu(tmp_path):
    r = _run(
        "benchmark",
        "parallel=single",
        "workload.prompt_lens=[30,7]",
        "workload.max_new_tokens=3",
        f"workload.out_dir={tmp_path}",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (result,) = tmp_path.glob("generation-*.json")
    data = json.loads(result.read_text())
    assert data["identical"] and data["parallel"]["num_generated_tokens"] == 6
    assert "greedy tokens identical to one process" in r.stdout

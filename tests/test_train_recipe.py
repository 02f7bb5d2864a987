"""recipes/train.py: its config composes and validates; it trains each family end to end."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "recipes" / "train.py"


def _recipe_module():
    spec = importlib.util.spec_from_file_location("train_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="train", overrides=overrides)


def test_train_config_composes_and_validates():
    recipe = _recipe_module()
    conf = recipe.load_train_config(_compose([]))
    assert (conf.parallel.tp, conf.parallel.pcp, conf.parallel.dp) == (2, 2, 1)
    assert conf.workload.strategy is recipe.Strategy.fabric and conf.workload.steps == 30
    assert recipe.tiny_lm_config(conf.model).attention == "gqa"
    mla = recipe.load_train_config(
        _compose(["model=deepseek_v3_tiny", "workload.strategy=trainer"])
    )
    assert recipe.tiny_lm_config(mla.model).attention == "mla"
    assert mla.workload.strategy is recipe.Strategy.trainer
    with pytest.raises(ValueError, match="workload.steps must be >= 1, got 0"):
        recipe.load_train_config(_compose(["workload.steps=0"]))
    # Types and enum values are checked when Hydra composes onto the schema.
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="workload.strategy=ddp"):
        _compose(["workload.strategy=ddp"])
    with pytest.raises(ValueError, match="model.vocab_size=100 is too small for byte-level tokens"):
        recipe.load_train_config(_compose(["model.vocab_size=100"]))


def _run(args, timeout=600):
    proc = subprocess.run(
        [sys.executable, str(RECIPE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _losses(out):
    return [float(x) for x in re.findall(r"step +\d+/\d+ +loss (\d+\.\d+)", out)]


@pytest.mark.distributed
def test_recipe_trains_each_family_with_pcp_and_tp(tmp_path):
    ckpt = tmp_path / "llama.safetensors"
    out = _run(
        ["model=llama_tiny", "workload.steps=4", "workload.log_every=1", f"workload.save={ckpt}"]
    )
    assert "training llama (gqa) with fabric on 4 rank(s): tp=2 pcp=2 dp=1" in out
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0], out[-2000:]
    assert re.search(
        r"done: llama \(gqa\) tp=2 pcp=2 dp=1: loss \d+\.\d+ -> \d+\.\d+ in 4 steps, \d+ tok/s", out
    )
    from cp_modules.models import TinyLM, TinyLMConfig
    from cp_modules.training import read_checkpoint

    state = read_checkpoint(ckpt)
    assert state["step"] == 4
    TinyLM(TinyLMConfig()).load_state_dict(state["model"])  # full tensors, one process

    out = _run(
        [
            "model=deepseek_v3_tiny",
            "workload.strategy=trainer",
            "workload.steps=4",
            "workload.log_every=1",
        ]
    )
    assert "training deepseek_v3 (mla) with trainer on 4 rank(s): tp=2 pcp=2 dp=1" in out
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0], out[-2000:]
    assert re.search(
        r"done: deepseek_v3 \(mla\) tp=2 pcp=2 dp=1: loss \d+\.\d+ -> \d+\.\d+ in 4 steps", out
    )
    assert torch.isfinite(torch.tensor(losses)).all()


@pytest.mark.distributed
def test_recipe_fine_tunes_a_transformers_model(tmp_path):
    # model=hf: a transformers Llama made context-parallel by swap_attention. Its seeded weights
    # saved by save_pretrained and fine-tuned from model.checkpoint (built on meta, sharded by
    # TP x FSDP2, each rank reading its shard) under Fabric and the Trainer on tp=2 x pcp=2,
    # and built from the config under the Trainer on one process: the same losses step by step.
    recipe = _recipe_module()
    sys.path.insert(0, str(ROOT / "recipes"))
    from recipe_models import build_model

    conf = recipe.load_train_config(_compose(["model=hf"]))
    build_model(conf.model).save_pretrained(str(tmp_path / "hf"))
    steps = ["workload.steps=3", "workload.log_every=1"]
    ckpt = ["model=hf", f"model.checkpoint={tmp_path / 'hf'}", *steps]
    out = _run(ckpt)
    assert "training llama (gqa, transformers model " in out and "with fabric on 4 rank(s)" in out
    parallel = _losses(out)
    trainer = _losses(_run([*ckpt, "workload.strategy=trainer"]))
    single = _losses(_run(["model=hf", "parallel=single", "workload.strategy=trainer", *steps]))
    assert len(parallel) == 3 and parallel[-1] < parallel[0], out[-2000:]
    assert parallel == single, (parallel, single)
    assert trainer == single, (trainer, single)

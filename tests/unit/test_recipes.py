"""The DAPO recipes (configs/*-dapo.yaml), checked without a GPU or an engine: each loads and validates at its job's
shape with its model's shape (examples/models/*.json) and carries the DAPO paper's settings; its data keys read
both stand-in layouts (examples/math/make_stand_in.py: DAPO-Math-17k's columns, verl's parquet) and math-verify
scores their answers as the policy would state them. Training on them: tests/engine/test_recipes_train.py (slow);
each launch script's plan: tests/unit/test_plan.py."""

import importlib.util
import json

import pytest

from helpers.scripts import ROOT
from megarl.algo.filters import overlong_ramp
from megarl.config import load_config, validate
from megarl.data.checks import check_data
from megarl.data.rows import keys_of, parse_row
from megarl.rewards.builtin import math_reward

# recipe → (the model's shape file, the job's GPUs)
RECIPES = {"qwen3-30b-a3b-dapo": ("qwen3-30b-a3b.json", 16), "qwen3-32b-dapo": ("qwen3-32b.json", 32)}
# stand-in layout → (training file, held-out file, a response stating its final answer as that layout's prompt asks)
LAYOUTS = {"dapo-math-17k": ("dapo-math-17k.parquet", "aime-2024.parquet", "Let me compute.\nAnswer: {}"),
           "verl": ("verl-math/train.parquet", "verl-math/test.parquet", "So the answer is $\\boxed{{{}}}$.")}


def recipe(name: str):
    return ROOT / "configs" / f"{name}.yaml"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_stand_in", ROOT / "examples" / "math" / "make_stand_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("stand_in")
    module.main(["--out", str(out), "--train", "8", "--test", "4"])
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_validates_at_its_job_with_the_dapo_papers_settings(name):
    shape, gpus = RECIPES[name]
    cfg = load_config(recipe(name), [])
    validate(cfg, gpus, json.loads((ROOT / "examples" / "models" / shape).read_text()), here=False)
    a, r = cfg.algo, cfg.rollout
    assert (a.preset, a.clip_low, a.clip_high) == ("dapo", 0.2, 0.28) and a.dynamic_sampling
    assert a.loss_agg == "token_mean"
    # responses up to 20,480 tokens, the last 4,096 penalised (the preset's 20%), to −1 on the paper's ±1 scale
    assert r.max_new_tokens == 20480
    assert overlong_ramp(a.overlong_cache, a.overlong_cache_frac, r.max_new_tokens) == 4096
    assert a.overlong_penalty == 0.5  # math-verify's 1/0: half of the paper's ±1 span
    assert cfg.engine.max_model_len == cfg.data.max_prompt_tokens + r.max_new_tokens
    assert (cfg.trainer.precision, cfg.optim.lr, cfg.reward.fn) == ("bf16", 1e-6, "math")
    assert (cfg.data.prompt_key, cfg.data.answer_key) == ("prompt", "reward_model.ground_truth")


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_recipes_data_keys_read_each_layout_and_math_verify_checks_its_answers(stand_in, name, layout):
    train, held_out, response = LAYOUTS[layout]
    cfg = load_config(recipe(name), [f"data.path={stand_in / train}", f"data.eval_path={stand_in / held_out}",
                                     "data.on_bad_row=error"])
    stores = check_data(cfg.data)  # the files, the keys, every row usable (on_bad_row=error)
    assert {key: len(store) for key, store in stores.items()} == {"data.path": 8, "data.eval_path": 4}
    for key, store in stores.items():
        for i in range(len(store)):
            prompt, answer, extras = parse_row(store.row(i)[1], f"{key} row {i}", keys_of(cfg.data, key))
            assert [m["role"] for m in prompt] == ["user"] and answer
            assert set(extras) == {"data_source", "ability", "reward_model", "extra_info"}  # to the reward as kwargs
            assert math_reward(response.format(answer), answer, **extras) == 1.0, (layout, answer)
            assert math_reward(response.format(f"{answer} + 1"), answer, **extras) == 0.0, (layout, answer)

"""The DAPO recipes (configs/*-dapo.yaml) train end to end on CPU: ``megarl train --config`` on each recipe with a
tiny model of its kind swapped in and the run shrunk (layout, engine, rollout sizes; fp32, faster on a CPU), its
data, reward and algo sections as they are, on the stand-in of a published dataset layout
(examples/math/make_stand_in.py): the DAPO-Math-17k columns for the MoE recipe, verl's parquet for the dense one.

A random tiny model scores the same on every sample, and DAPO's dynamic sampling would drop every group: a short
warm-up on the stand-in's prompts answered right and wrong alike (half each) makes each prompt's samples differ, so
math-verify's rewards vary within groups and both steps train."""

import json
import subprocess
import sys

import pytest

from helpers.runs import megarl, scalars
from helpers.scripts import ROOT

# (recipe, tiny model of its kind, training file, held-out file, how a response states its final answer)
RECIPES = {
    "qwen3-30b-a3b-dapo": ("qwen3_moe", "dapo-math-17k.parquet", "aime-2024.parquet", "Answer: {}"),
    "qwen3-32b-dapo": ("qwen2", "verl-math/train.parquet", "verl-math/test.parquet", "\\boxed{{{}}}"),
}


def shrunk(tmp, tiny: str, train: str, held_out: str) -> list[str]:
    """The run made CPU-sized: one process, a tiny model, short responses; data paths to the stand-in."""
    return [f"model.path={tmp}/model", f"model.make_tiny={tiny}", "parallel.tp=1", "parallel.ep=1",
            "parallel.etp=0", "parallel.sequence_parallel=false", "engine.tensor_parallel_size=1",
            "engine.max_model_len=320", "engine.slots=32", "engine.kv_cache_gib=0.125", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=8", "rollout.max_new_tokens=24", "optim.micro_batch_size=8",
            "trainer.recompute=none", "trainer.precision=fp32", "reward.workers=1", f"data.path={tmp}/data/{train}",
            f"data.eval_path={tmp}/data/{held_out}", "data.eval_size=4", "data.max_prompt_tokens=0",
            f"warmup.path={tmp}/warmup.jsonl", "warmup.steps=60", "warmup.batch_size=16", "warmup.lr=3e-3",
            "train.steps=2", "train.eval_every=0", f"train.run_dir={tmp}/run"]


def warmup_file(tmp, train: str, answer: str) -> None:
    """Each stand-in prompt answered right and wrong (the ground truth + 1), in the response format of its layout."""
    import pyarrow.parquet as pq

    with open(tmp / "warmup.jsonl", "w") as f:
        for row in pq.read_table(tmp / "data" / train).to_pylist():
            truth = row["reward_model"]["ground_truth"]
            for said in (truth, f"{truth} + 1"):
                f.write(json.dumps({"messages": [*row["prompt"],
                                                 {"role": "assistant", "content": answer.format(said)}]}) + "\n")


@pytest.fixture(scope="module", params=sorted(RECIPES))
def trained(request, tmp_path_factory):
    recipe = request.param
    tiny, train, held_out, answer = RECIPES[recipe]
    tmp = tmp_path_factory.mktemp(recipe)
    subprocess.run([sys.executable, "examples/math/make_stand_in.py", "--out", str(tmp / "data"), "--train", "16",
                    "--test", "4"], cwd=ROOT, check=True, capture_output=True)
    warmup_file(tmp, train, answer)
    proc = megarl("train", "--config", str(ROOT / "configs" / f"{recipe}.yaml"), *shrunk(tmp, tiny, train, held_out),
                  timeout=1200)
    return recipe, tmp, proc


@pytest.mark.slow
def test_a_recipe_trains_two_steps_on_its_dataset_layout_with_math_verify_rewards(trained):
    recipe, tmp, proc = trained
    s = scalars(tmp / "run")
    assert len(s["reward/mean"]) == 2, (recipe, sorted(s))  # both steps trained: informative groups each step
    assert all(0.0 < v < 1.0 for v in s["reward/mean"]), s["reward/mean"]  # math-verify scored right and wrong
    assert s["reward/errors"][-1] == 0.0 and s["reward/timeouts"][-1] == 0.0
    assert s["data/bad_rows"][-1] == 0.0 and s["data/prompts_too_long"][-1] == 0.0  # every row of the layout read
    assert "loss/policy" in s and len(s["loss/policy"]) == 2
    assert "rollout/groups_filtered" in s  # DAPO's dynamic sampling ran (the recipe's algo section)
    assert "eval/pass_at_1" in s  # the held-out file of the same layout was read and scored

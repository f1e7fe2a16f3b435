"""LoRA adapters on the megatron-core trainer (real megatron-core, gloo; megarl/trainer/lora.py): with B at zero the
logprobs are the base model's exactly, an adapted layer is W x + (alpha / r) · B A x, only the adapters have
gradients and optimizer state (the base frozen in the trainer's precision), and at TP 2 (with and without sequence
parallelism), PP 2, PP 2 with 2 virtual stages each, CP 2, DP 2 and, on a tiny MoE with adapters on attention and
every routed expert, EP 2,
the adapters' gradients after one step (every rank's, as the step's reduction left them, by global name) are one
process's, and so are the adapters the sync and the export gather (``lora_peft.gather_adapters``).

In a run's dist checkpoint (checkpoint/dist.py): one step with adapters, saved, loaded into a fresh trainer at the same
layout, another TP or interleaved pipeline stages, and the next step is the uninterrupted run's (the adapters as saved,
a TP-split B or A whole again and linear_fc1's gate/up halves in place; the loss and adapter gradients; the adapters
after it: Adam's moments and step came back with them); a checkpoint whose adapters differ from the trainer's is
refused, naming what differs.
"""

import json

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

_RUNS: dict = {}
_SAVED: dict = {}
ATTENTION = "linear_qkv,linear_proj"
MOE_ALL = "linear_qkv,linear_proj,experts"  # (a Qwen3-MoE has no dense MLP layer)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return make_tiny_model(root / "qwen2", TinyShape(family="qwen2"), seed=3), root


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_moe")
    return make_tiny_model(root / "qwen3_moe", TinyShape(family="qwen3_moe"), seed=3), root


def run(model, layout: str, precision: str = "fp32", targets: str = "", dropout: float = 0.0) -> dict:
    path, root = model
    key = (path, layout, precision, targets, dropout)
    if key not in _RUNS:
        out = root / f"{layout}-{precision}{'-' + targets.replace(',', '-') if targets else ''}-d{dropout}"
        launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        run_script([*launcher, "tests/workers/lora_checks.py", layout, str(path), str(out), precision,
                    targets or "", str(dropout)], env={"OMP_NUM_THREADS": "1"})
        _RUNS[key] = json.loads((out / "result.json").read_text())
    return _RUNS[key]


def grad_gap(ref: dict, got: dict) -> float:
    """The largest gap of any rank's adapter gradient to one process's (by global name), relative to each
    gradient's largest entry (the gradients are ~1e-3)."""
    gaps = []
    for grads in got["rank_grads"]:
        assert grads.keys() == ref["grads"].keys()  # every adapter, under its global name
        for name, g in ref["grads"].items():
            g, mine = torch.tensor(g), torch.tensor(grads[name])
            assert mine.shape == g.shape, name
            gaps.append(float((mine - g).abs().max() / g.abs().max()))
    return max(gaps)


def test_b_at_zero_is_the_base_model_and_only_adapters_train(model):
    got = run(model, "single")
    assert got["b_zero_gap"] == 0.0  # B = 0: the first step's logprobs are the base model's, exactly
    assert got["adapters_off_gap"] == 0.0  # adapters_off: the base model (the KL reference without a second model)
    assert got["b_random_gap"] > 1e-2  # the adapters act once B moves
    assert got["dense_gap"] < 1e-6  # W x + b + (alpha / r) · B A x, column- and row-parallel layers
    adapters = got["adapter_params"]
    assert 0 < adapters < got["base_params"] / 10
    # nothing of the base reaches DDP's gradient buffer or the optimizer: no main copy, no Adam state
    assert got["trainable"] == got["grad_buffer"] == got["optimizer_params"] == adapters
    assert got["adam_state"] == 2 * adapters
    assert all(any(x != 0 for row in g for x in row) for g in got["grads"].values())  # A and B both get gradients


@pytest.mark.slow  # (a second 1-process run)
def test_bf16_keeps_the_base_in_bf16_with_fp32_main_copies_of_the_adapters_only(model):
    got = run(model, "single", "bf16")
    assert got["base_dtypes"] == ["torch.bfloat16"] and got["optimizer_main_dtypes"] == ["torch.float32"]
    assert got["optimizer_params"] == got["adapter_params"] and got["adam_state"] == 2 * got["adapter_params"]
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0


PARALLEL = ["tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2", "dp2"]


@pytest.mark.slow  # (a 2-process run each)
@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_adapter_gradients_are_one_processs(model, layout):
    ref, got = run(model, "single"), run(model, layout)
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0
    assert got["b_random_gap"] == pytest.approx(ref["b_random_gap"], rel=1e-4)
    if layout.startswith("tp2"):  # this rank's shards: B or A split
        assert got["trainable"] == got["optimizer_params"] < ref["trainable"]
    elif layout.startswith("pp2"):  # this stage's 2 layers of 4 (pp2_vpp2: 2 chunks of one, layers 0 and 2 or 1 and 3)
        assert 2 * got["trainable"] == 2 * got["optimizer_params"] == ref["trainable"]
    elif layout == "cp2":  # replicated over CP (each rank half of every row), DP 1: the whole optimizer
        assert got["trainable"] == got["optimizer_params"] == ref["trainable"]
    else:  # replicated over DP; the distributed optimizer holds this rank's share
        assert got["trainable"] == ref["trainable"] and got["optimizer_params"] < got["trainable"]
    # every rank's gradient after the step's reduction (DP: the distributed optimizer's reduced shards gathered; a
    # rank's own unreduced gradient is ~1 off; CP: all-reduced over the CP ranks, each of which ran its half of
    # every row): measured 1.1e-6 (tp2), 9.7e-7 (tp2_sp), 6.3e-7 (pp2), 4.5e-7 (pp2_vpp2), 7.0e-7 (cp2), 5.0e-7 (dp2)
    assert grad_gap(ref, got) < 1e-5


@pytest.mark.slow  # (the gradient test's runs)
@pytest.mark.parametrize("layout", PARALLEL)
def test_adapters_gathered_for_the_sync_and_export_are_one_processs(model, layout):
    """``lora_peft.gather_adapters`` (the adapter sync's and the PEFT export's): every adapter whole on every rank,
    under its global base layer name (virtual stages' layers numbered over the interleaved chunks), exactly one
    process's (A drawn whole per global layer, B a random one drawn by global name)."""
    ref, got = run(model, "single"), run(model, layout)
    (adapters,) = ref["rank_adapters"]
    assert len(adapters) == 16  # 4 layers × 4 targets
    assert all(every == adapters for every in got["rank_adapters"])


@pytest.mark.slow  # (two 1-process runs and a 2-process run)
def test_dropout_on_an_input_every_tp_rank_holds_draws_one_processs_masks(model):
    """``lora.dropout`` at TP 2 without sequence parallelism: a column-parallel layer's input is whole on both ranks
    and its masks come from the tracker's stream seeded alike over the TP group (``trainer.lora.TIED``), so both
    ranks drop what one process drops: the replicated A stays one tensor and every gradient is one process's, also
    after each rank's stream was made its own (as a run checkpoint of another layout leaves it) and tied again as each
    RL step ties it (``tie_dropout``). (Untied, each rank its own masks, the gap was 0.70.)"""
    ref, got = run(model, "single", targets="linear_qkv,linear_fc1", dropout=0.1), \
        run(model, "tp2", targets="linear_qkv,linear_fc1", dropout=0.1)
    assert grad_gap(ref, got) < 1e-5
    assert grad_gap(run(model, "single", targets="linear_qkv,linear_fc1"), ref) > 1e-2  # (the masks act)
    tied, own = ({s[k] for s in got["streams"]} for k in ("lora-dropout-tied", "model-parallel-rng"))
    assert len(tied) == 1 and len(own) == 2  # (a split input's stream: each TP rank its own, as on GPUs)


@pytest.mark.slow  # (a 1- and a 2-process run of the MoE)
def test_expert_parallel_adapter_gradients_are_one_processs(moe_model):
    """Adapters on attention and on every routed expert (``experts``) at EP 2: each rank holds its own experts'
    adapters, reduced over expert DP (1 here) while attention's are over DP 2; the gradients, the adapters the sync
    gathers and the plan's count of them are one process's."""
    from megarl.config import load_config
    from megarl.launch.model_size import adapter_params

    ref, got = run(moe_model, "single", targets=MOE_ALL), run(moe_model, "ep2_alltoall", targets=MOE_ALL)
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0
    assert got["b_random_gap"] == pytest.approx(ref["b_random_gap"], rel=1e-4)
    experts = [n for n in ref["grads"] if ".mlp.experts.local_experts." in n]
    assert len(experts) == 4 * 4 * 2 * 2  # 4 layers × 4 experts × (fc1, fc2) × (A, B), each with a gradient
    assert all(any(x != 0 for row in ref["grads"][n] for x in row) for n in experts)
    assert grad_gap(ref, got) < 1e-5  # measured 1.2e-6
    assert all(every == ref["rank_adapters"][0] for every in got["rank_adapters"])  # each expert's, whole, everywhere
    hf = json.loads((moe_model[0] / "config.json").read_text())
    cfg = load_config(None, [f"lora.rank={ref['rank']}", f"lora.targets={MOE_ALL}"])
    assert ref["adapter_params"] == adapter_params(hf, cfg)  # the plan counts what the trainer holds
    assert got["trainable"] == adapter_params(hf, cfg, ep=2) < ref["trainable"]  # an EP rank: half the experts'
    # the distributed optimizer shards attention's adapters over DP 2, not the experts' (expert DP 1)
    attention = adapter_params(hf, load_config(None, [f"lora.rank={ref['rank']}", f"lora.targets={ATTENTION}"]))
    assert got["optimizer_params"] == got["trainable"] - attention / 2


@pytest.mark.slow  # (a 2-process run of the MoE)
def test_expert_adapters_split_over_expert_tp_have_one_processs_gradients(moe_model):
    """TP 2 with sequence parallelism, expert TP 2 (its default: parallel.tp's): each expert's fc1 B and fc2 A split
    over expert TP, the token dispatcher moving the layer's inputs and outputs; the replicated factor's gradient,
    partial on each rank, is summed over expert TP (without that sum the gap is 0.97)."""
    ref, got = run(moe_model, "single", targets=MOE_ALL), run(moe_model, "tp2_sp", targets=MOE_ALL)
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0
    assert got["b_random_gap"] == pytest.approx(ref["b_random_gap"], rel=1e-4)
    assert grad_gap(ref, got) < 1e-5  # measured 1.4e-6
    assert all(every == ref["rank_adapters"][0] for every in got["rank_adapters"])
    from megarl.config import load_config
    from megarl.launch.model_size import adapter_params

    hf = json.loads((moe_model[0] / "config.json").read_text())
    cfg = load_config(None, [f"lora.rank={ref['rank']}", f"lora.targets={MOE_ALL}"])
    assert got["trainable"] == adapter_params(hf, cfg, tp=2, etp=2)  # the plan counts a TP rank's share


# LoRA adapters in dist checkpoints (tests/workers/lora_checkpoint_checks.py)


def launch(action: str, layout: str, model_dir, work, targets: str = "") -> dict:
    launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    run_script([*launcher, "tests/workers/lora_checkpoint_checks.py", action, layout, str(model_dir), str(work),
                *([targets] if targets else [])], env={"OMP_NUM_THREADS": "1"})
    return torch.load(work / f"{action}-{layout}.pt")


def saved_at(model, layout: str, targets: str = ""):
    """The save run at ``layout`` (once per module and targets): its work directory and what it measured."""
    path, root = model
    if (path, layout, targets) not in _SAVED:
        work = root / f"saved-{layout}{'-' + targets.replace(',', '-') if targets else ''}"
        work.mkdir()
        _SAVED[path, layout, targets] = work, launch("save", layout, path, work, targets)["expected"]
    return _SAVED[path, layout, targets]


def gap(expected: dict, got: dict) -> float:
    """The largest gap of any tensor to the expected one, relative to that tensor's largest entry."""
    assert expected.keys() == got.keys()
    return max(float((expected[k] - got[k]).abs().max() / expected[k].abs().max()) for k in expected)


def test_adapters_resume_exactly_and_a_checkpoint_with_other_adapters_is_refused(model):
    path, root = model
    (root / "roundtrip").mkdir()
    got = launch("roundtrip", "single", path, root / "roundtrip")
    expected, resumed = got["expected"], got["got"]
    assert len(expected["at_save"]) == 32  # 4 layers × 4 targets × (A, B)
    assert all(float(v.abs().max()) > 0 for k, v in expected["at_save"].items() if k.endswith(".b"))  # B moved
    for part in ("at_save", "grads", "after"):
        assert gap(expected[part], resumed[part]) == 0.0, part
    assert resumed["loss"] == expected["loss"]
    errors = got["errors"]
    ckpt = str(root / "roundtrip" / "ckpt")
    for case in ("no_lora_here", "no_lora_here_weights_only"):  # never the base alone
        assert errors[case].startswith(f"{ckpt} holds LoRA adapters (rank 4: 8 tensors") and "has none" in errors[case]
    assert "LoRA run's checkpoint" in errors["as_base_weights"]  # model.path: its base weights would drop them
    assert errors["other_rank"] == f"{ckpt}: lora.rank 4 in the checkpoint, 2 here"
    assert errors["other_alpha"] == f"{ckpt}: lora.alpha 8 in the checkpoint, 16 here"
    assert "(lora.targets)" in errors["other_targets"] and "linear_fc2.lora.a" in errors["other_targets"]
    assert "holds no LoRA adapters (saved without lora)" in errors["no_lora_saved"]


@pytest.mark.slow  # (a save and a load run, 2 processes)
@pytest.mark.parametrize("saved,loaded", [
    ("tp2_sp", "tp2_sp"),  # the same layout: exact
    ("single", "tp2_sp"),  # B of linear_qkv / linear_fc1 (gate, up) and A of linear_proj / linear_fc2 split on load
    ("tp2_sp", "single"),  # and joined
    ("dp2", "tp2_sp"),  # the distributed optimizer's fully reshardable state (DP 2) into TP 2
    ("single", "pp2_vpp2"),  # each layer's adapters into its interleaved chunk ('model0', 'model1')
    ("pp2_vpp2", "single"),  # and back
])
def test_adapters_and_their_optimizer_state_reshard_across_layouts(model, saved, loaded):
    work, expected = saved_at(model, saved)
    got = launch("load", loaded, model[0], work)["got"]
    assert gap(expected["at_save"], got["at_save"]) == 0.0  # the adapters as saved, whole: exactly
    if saved == loaded:
        assert gap(expected["grads"], got["grads"]) == gap(expected["after"], got["after"]) == 0.0
        assert got["loss"] == expected["loss"]
        return
    # Another TP reduces in another order: measured 1.7e-7 (loss), 7.5e-7 (gradients, relative to each tensor's
    # largest entry), 2.4e-7 (adapters after the step); PP 2 × VPP 2 ↔ one process: 2.5e-7, 3.7e-7, 4.9e-8. A shard
    # lost or misplaced is a gap of order 1; Adam's state lost moves the adapters by ~1e-3 (measured 1.7e-3).
    assert abs(got["loss"] - expected["loss"]) <= 1e-6 * abs(expected["loss"])
    assert gap(expected["grads"], got["grads"]) <= 2e-6
    assert max(float((expected["after"][k] - got["after"][k]).abs().max()) for k in expected["after"]) <= 1e-5


@pytest.mark.slow  # (a save and a load run, one of them 2 processes)
@pytest.mark.parametrize("saved,loaded", [("ep2_alltoall", "single"), ("single", "ep2_alltoall"),
                                         ("tp2_sp", "single")])
def test_expert_adapters_and_their_optimizer_state_reshard_across_ep_and_expert_tp(moe_model, saved, loaded):
    """Each expert's adapters saved under its global number (as its weights are): saved at EP 2 (each rank its two
    experts), loaded by one process holding all four, and back; saved split over expert TP 2 and joined. The next
    step is the uninterrupted run's."""
    work, expected = saved_at(moe_model, saved, MOE_ALL)
    got = launch("load", loaded, moe_model[0], work, MOE_ALL)["got"]
    assert sum(".mlp.experts.local_experts." in k for k in got["at_save"]) == 4 * 4 * 2 * 2
    assert gap(expected["at_save"], got["at_save"]) == 0.0  # the adapters as saved: exactly
    assert abs(got["loss"] - expected["loss"]) <= 1e-6 * abs(expected["loss"])
    assert gap(expected["grads"], got["grads"]) <= 2e-6
    assert max(float((expected["after"][k] - got["after"][k]).abs().max()) for k in expected["after"]) <= 1e-5

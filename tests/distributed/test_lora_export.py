"""A LoRA run's export (megarl/convert/export_lora.py) and tools/merge_lora.py, against the trainer and ``peft``.

The trainer's adapters (random B, so that they act; fp32) are exported as a run exports them, at one process and at
2-process layouts (TP 2 with sequence parallelism, PP 2): the directory loads in ``peft`` over the base
(``PeftModel.from_pretrained``) and gives the trainer's logprobs. ``tools/merge_lora.py`` merges it into the base,
written by transformers in several shards: the merged checkpoint keeps the base's shard layout, gives ``peft``'s
logits in transformers, and passes the conversion check (``tools/check_conversion.py`` against ``hf-to-mcore``'s
conversion of it). The tool's bad inputs: ``tests/unit/test_merge_lora.py``.
"""

import json
import subprocess
import sys

import pytest
import torch

from helpers.conversion import convert, safetensors_bytes
from helpers.hf_models import make_hf_model
from helpers.scripts import ROOT, run_script

RANK, ALPHA = 4, 8.0  # (tests/workers/lora_export_checks.py's)
MODULES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
FAST = [("qwen2", "single")]  # q/k/v biases, untied
SLOW = [("llama_tied_llama3", "tp2_sp"), ("qwen3_tied", "pp2")]  # tied embeddings; Qwen3's q/k norms
_RUNS: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_export")


def export(root, family: str, layout: str, targets: str = "") -> tuple:
    """(base, adapter dir, the worker's trainer.pt) of the trainer at ``layout`` over the tiny ``family``."""
    if (family, layout, targets) not in _RUNS:
        base = root / family
        if not base.exists():
            make_hf_model(base, family, seed=1, max_shard_size="300KB")
        out = root / f"{family}-{layout}{'-' + targets.replace(',', '-') if targets else ''}"
        launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        run_script([*launcher, "tests/workers/lora_export_checks.py", layout, str(base), str(out),
                    *([targets] if targets else [])], env={"OMP_NUM_THREADS": "1"})
        _RUNS[family, layout, targets] = base, out / "hf" / "step_1", torch.load(out / "trainer.pt")
    return _RUNS[family, layout, targets]


def peft_model(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     str(adapter)).eval()


def logprobs(logits, labels) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("family,layout", [*FAST, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW)])
def test_exported_adapter_loads_in_peft_and_gives_the_trainers_logprobs(root, family, layout):
    from safetensors import safe_open

    base, adapter, got = export(root, family, layout)
    # a PEFT adapter directory: the adapter and the base's tokenizer; the base's config and weights stay the base's
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # export_hf called directly: the same
        assert (adapter / name).read_bytes() == (adapter.parent.parent / "direct" / name).read_bytes()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base.resolve())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == ("LORA", RANK, ALPHA, [*MODULES])
    hf = json.loads((base / "config.json").read_text())
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert len(shapes) == hf["num_hidden_layers"] * len(MODULES) * 2
    q = "base_model.model.model.layers.3.self_attn.q_proj"  # (the last layer: the last pipeline stage's at PP 2)
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    assert shapes[f"{q}.lora_A.weight"] == (RANK, hf["hidden_size"])
    assert shapes[f"{q.replace('q_proj', 'k_proj')}.lora_B.weight"] == (kv_rows, RANK)
    assert shapes[f"{q.replace('self_attn.q_proj', 'mlp.up_proj')}.lora_B.weight"] == (hf["intermediate_size"], RANK)
    mask = got["loss_mask"].bool()
    theirs, theirs_base = adapted(peft_model(base, adapter), got)
    assert float((got["logprobs"] - got["base"])[mask].abs().max()) > 0.5  # the adapters act
    assert float((theirs_base - got["base"])[mask].abs().max()) <= 1e-4  # the same base
    assert float((theirs - got["logprobs"])[mask].abs().max()) <= 1e-4  # and the same adapters


def merge(root, family="qwen2", layout="single", targets=""):
    """tools/merge_lora.py (in this process) on the export, the base from its adapter_config.json."""
    import importlib.util

    base, adapter, got = export(root, family, layout, targets)
    out = adapter.parent.parent.parent / f"{adapter.parent.parent.name}-merged"
    if not out.exists():
        spec = importlib.util.spec_from_file_location("merge_lora", ROOT / "tools/merge_lora.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        assert tool.main(["--adapter", str(adapter), "--out", str(out)]) == 0
    return base, adapter, got, out


def adapted(model, got) -> tuple[torch.Tensor, torch.Tensor]:
    """A peft model's logprobs of the trainer's batch, with its adapters and without."""
    with torch.no_grad():
        theirs = logprobs(model(got["input_ids"]).logits, got["labels"])
        with model.disable_adapter():
            return theirs, logprobs(model(got["input_ids"]).logits, got["labels"])


def test_merged_checkpoint_keeps_the_shard_layout_and_gives_pefts_logits(root):
    from transformers import AutoModelForCausalLM

    base, adapter, got, merged = merge(root)
    # the base's shards (transformers wrote several), index and files, each shard with the base's tensors
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in merged.glob("*.safetensors")) == shards
    assert {p.name for p in merged.iterdir()} == {p.name for p in base.iterdir()}
    index = "model.safetensors.index.json"
    assert json.loads((merged / index).read_text()) == json.loads((base / index).read_text())
    before, after = safetensors_bytes(base), safetensors_bytes(merged)
    assert after.keys() == before.keys()
    changed = {k for k in before if after[k] != before[k]}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(4)
                       for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert all(after[k][:2] == before[k][:2] for k in before)  # dtypes and shapes
    with torch.no_grad():
        theirs = peft_model(base, adapter)(got["input_ids"]).logits
        ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(got["input_ids"]).logits
    assert float((ours - theirs).abs().max()) <= 1e-4
    mask = got["loss_mask"].bool()
    assert float((logprobs(ours, got["labels"]) - got["logprobs"])[mask].abs().max()) <= 1e-4  # the trainer's


@pytest.mark.slow  # (a conversion and the check: two megatron processes, ~20 s)
def test_merged_checkpoint_passes_the_conversion_check(root):
    _, _, _, merged = merge(root)
    convert("hf-to-mcore", "--hf", merged, "--out", root / "merged-ckpt")
    proc = subprocess.run([sys.executable, "tools/check_conversion.py", "--hf", str(merged), "--ckpt",
                           str(root / "merged-ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "check_conversion: PASS" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["max_abs_logit_diff"] <= 1e-4


MOE_ALL = "linear_qkv,linear_proj,experts"


def test_expert_adapters_export_as_pefts_fused_experts_and_merge_into_each_expert(root):
    """Adapters on every routed expert of a Qwen3-MoE (written by transformers, whose Qwen3MoeExperts hold all
    experts in one gate_up_proj and one down_proj): exported in PEFT's ``target_parameters`` layout, they load in
    ``peft`` with the trainer's logprobs; merged, each expert's weights in the base's per-expert tensors change and
    the merged model gives the trainer's logprobs."""
    from safetensors import safe_open

    from megarl.models.hf_config import num_experts

    base, adapter, got, merged = merge(root, "qwen3_moe", "single", MOE_ALL)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = json.loads((base / "config.json").read_text())
    experts, h, fe = num_experts(hf), hf["hidden_size"], hf["moe_intermediate_size"]  # (transformers 5 writes
    # num_local_experts)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    layer = "base_model.model.model.layers.3.mlp.experts"
    assert shapes[f"{layer}.base_layer.lora_A.weight"] == (experts * RANK, h)  # gate_up_proj: every expert's A
    assert shapes[f"{layer}.base_layer.lora_B.weight"] == (2 * fe, experts * RANK)
    assert shapes[f"{layer}.lora_A.weight"] == (experts * RANK, fe)  # down_proj
    assert len(shapes) == hf["num_hidden_layers"] * (4 + 2) * 2
    mask = got["loss_mask"].bool()
    theirs, theirs_base = adapted(peft_model(base, adapter), got)
    assert float((got["logprobs"] - got["base"])[mask].abs().max()) > 0.5  # the adapters act
    assert float((theirs_base - got["base"])[mask].abs().max()) <= 1e-4
    assert float((theirs - got["logprobs"])[mask].abs().max()) <= 1e-4  # measured 6.7e-6
    before, after = safetensors_bytes(base), safetensors_bytes(merged)
    changed = {k for k in before if after[k] != before[k]}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(hf["num_hidden_layers"]) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        *(f"mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")))}
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(got["input_ids"]).logits
    assert float((logprobs(ours, got["labels"]) - got["logprobs"])[mask].abs().max()) <= 1e-4  # measured 1.3e-5


@pytest.mark.slow  # (a 2-process export)
def test_expert_adapters_exported_at_ep2_are_one_processs_byte_for_byte(root):
    """Each EP rank holds its own experts' adapters (A drawn by the expert's global number, B by its global name):
    the export gathers them over the EP group into the file one process writes."""
    _, single, _ = export(root, "qwen3_moe", "single", MOE_ALL)
    _, ep2, _ = export(root, "qwen3_moe", "ep2_alltoall", MOE_ALL)
    name = "adapter_model.safetensors"
    assert (ep2 / name).read_bytes() == (single / name).read_bytes()


@pytest.mark.slow  # (a vLLM engine start for each)
@pytest.mark.parametrize("family,targets", [("qwen2", ""), ("qwen3_moe", MOE_ALL)])
def test_exported_adapter_directory_loads_in_vllm_with_the_trainers_logprobs(root, family, targets):
    """vLLM reads the directory itself (a ``LoRARequest`` of its path) over the base: each token's logprob is the
    trainer's; the experts' fused layout with vLLM's ``enable_mixed_moe_lora_format`` and ``is_3d_lora_weight``."""
    base, adapter, _ = export(root, family, "single", targets)
    r = run_script(["tests/workers/vllm_adapter_dir_checks.py", str(base), str(adapter),
                    str(adapter.parent.parent / "trainer.pt")], env={"OMP_NUM_THREADS": "1"})
    assert r["gap_base"] > 0.5 and r["gap"] <= 1e-4  # measured 1.5e-5 (Qwen2), 7.6e-6 (Qwen3-MoE, experts)

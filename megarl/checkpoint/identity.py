"""Which model a checkpoint holds, so that one of another model is refused before anything loads.

A megatron dist checkpoint (a run's ``step_N/policy`` or a converted one) names its tensors and
their global shapes in its metadata, whatever layout saved it; those shapes give the model's
architecture (``from_tensors``): hidden size, layers, attention and KV widths, vocabulary,
experts and how many layers have them (``layer_axis.py``), qkv biases, a separate output layer (untied embeddings), qk
norms. The same is computed from an HF ``config.json`` (``from_hf_config``) and the two compared (``check_same_model``).
What the checkpoint records of its source names it in the error: a run's ``config.json``
(``model.path``), a converted checkpoint's ``megarl_conversion.json`` and ``hf/config.json``; that
source config is also compared on what shapes cannot show: head counts, dense-layer placement, RoPE
(type, theta, scaling), the norm's epsilon, the router's top-k and renormalisation.
Only the architecture is compared, never paths (a copy of the model elsewhere is the same model).
A critic's checkpoint (a run's ``step_N/critic``: the value head ``output_layer.weight [1, hidden]``
plus its bias in place of the LM head) is refused first: its weights are not a policy's.
A run's relative ``model.path`` is looked up relative to the directory the run was launched
from (told by the run dir's recorded ``train.run_dir``), as well as the current one.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megarl.models.hf_config import (
    has_qk_norm,
    has_qkv_bias,
    is_moe_layer,
    norm_topk_prob,
    num_experts,
    rms_norm_eps,
    rope_parameters,
)

LEARNERS = ("policy", "critic", "reference")
_QKV = "decoder.layers.self_attention.linear_qkv"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


class ModelMismatch(ValueError):
    """A checkpoint of another model than the one it would be loaded into."""


def from_hf_config(cfg: dict) -> dict:
    """The architecture an HF config defines, in the terms a dist checkpoint's tensors show."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return {"hidden size": hidden, "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
            "attention width (heads × head_dim)": heads * head_dim,
            "KV width (kv heads × head_dim)": cfg["num_key_value_heads"] * head_dim,
            "experts": num_experts(cfg), "layers with experts": _moe_layers(cfg), "qkv biases": has_qkv_bias(cfg),
            "tied embeddings": bool(cfg.get("tie_word_embeddings", False)), "qk norm": has_qk_norm(cfg)}


def _moe_layers(cfg: dict) -> int:
    return sum(is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"]))


def _rope(cfg: dict) -> str:
    """The RoPE a config defines, numbers as floats (``8`` and ``8.0`` are the same factor), keys sorted."""
    params = rope_parameters(cfg)
    return ", ".join(f"{k}={float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v}"
                     for k, v in sorted(params.items()))


def _with_config_math(cfg: dict) -> dict:
    """``from_hf_config`` plus what a config records and tensor shapes do not: the head counts, which layers
    are dense beside experts (the router's stacked axis counts the MoE layers, not where they are), and the
    numbers the trainer builds its math from (RoPE, the norm's epsilon, the router's top-k and whether its
    weights are renormalised): another value there gives another model with the same tensors."""
    moe = num_experts(cfg) > 0
    dense = [i for i in range(cfg["num_hidden_layers"]) if moe and not is_moe_layer(cfg, i)]
    return {**from_hf_config(cfg), "attention heads": cfg["num_attention_heads"],
            "KV heads": cfg["num_key_value_heads"],
            "dense layers": dense or "none", "RoPE": _rope(cfg), "RMS norm eps": rms_norm_eps(cfg),
            "experts per token": cfg.get("num_experts_per_tok") if moe else "none",
            "top-k weights renormalised": norm_topk_prob(cfg) if moe else "none"}


def from_tensors(shapes: dict[str, tuple]) -> dict:
    """The same architecture read from a dist checkpoint's model tensors (name → global shape)."""
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    proj = shapes.get("decoder.layers.self_attention.linear_proj.weight")
    qkv = shapes.get(f"{_QKV}.weight")
    out = {"hidden size": hidden, "vocab": vocab}
    if proj is not None and qkv is not None:
        out.update({"layers": qkv[0], "attention width (heads × head_dim)": proj[-1],
                    "KV width (kv heads × head_dim)": (qkv[1] - proj[-1]) // 2})
    router = shapes.get("decoder.layers.mlp.router.weight")
    out.update({"experts": router[1] if router is not None else 0,
                "layers with experts": router[0] if router is not None else 0, "qkv biases": f"{_QKV}.bias" in shapes,
                "tied embeddings": "output_layer.weight" not in shapes,
                "qk norm": "decoder.layers.self_attention.q_layernorm.weight" in shapes})
    return out


def saved_tensors(ckpt: str | Path) -> dict:
    """Key → torch's TensorStorageMetadata (global size, dtype, chunks) of a dist checkpoint."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def model_tensor_shapes(ckpt: str | Path) -> dict[str, tuple]:
    """Name → global shape of the model tensors of the dist checkpoint ``ckpt`` (optimizer state left out)."""
    return {k: tuple(v.size) for k, v in saved_tensors(ckpt).items() if k.startswith(_MODEL_PREFIXES)}


def is_value_head(shapes: dict[str, tuple]) -> bool:
    """Whether a dist checkpoint's tensors carry a critic's value head (one output row plus a bias)
    rather than an LM head (vocabulary rows, no bias) or tied embeddings (no output layer)."""
    out = shapes.get("output_layer.weight")
    return "output_layer.bias" in shapes or (out is not None and out[0] == 1)


def refuse_value_head(ckpt: Path, shapes: dict[str, tuple]) -> None:
    """``ModelMismatch`` for a critic's checkpoint loaded as a policy, naming the policy to pass instead."""
    if not is_value_head(shapes):
        return
    policy = ckpt.parent / "policy" if ckpt.name in LEARNERS else None
    hint = (f"pass the policy of the same step, {policy}" if policy is not None and policy.is_dir()
            else "pass a policy checkpoint (a run's step_N/policy, or the step dir step_N itself)")
    raise ModelMismatch(f"{ckpt} is a critic's checkpoint (its output layer is a value head, output_layer.weight "
                        f"{list(shapes['output_layer.weight'])} and a bias, not the language-model head), "
                        f"not a policy's: {hint}")


def run_dir_of(ckpt: Path) -> Path | None:
    """The run directory of a run checkpoint (``run/checkpoints/step_N[/policy]``), else None."""
    step = ckpt.parent if ckpt.name in LEARNERS else ckpt
    return step.parent.parent if step.parent.name == "checkpoints" else None


def launch_dir_of(run: Path) -> Path | None:
    """The directory a run was launched from, when its ``config.json`` records ``train.run_dir`` relative:
    the run dir's absolute path less those trailing parts (``/home/u/x/runs/a`` recorded as ``runs/a`` →
    ``/home/u/x``)."""
    try:
        recorded = Path(json.loads((run / "config.json").read_text())["train"]["run_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if recorded.is_absolute() or ".." in recorded.parts:
        return None
    here = run.resolve()
    n = len(recorded.parts)
    if n == 0 or here.parts[-n:] != recorded.parts:
        return None
    return Path(*here.parts[:-n]) if len(here.parts) > n else None


def model_path_candidates(path: str, run: Path) -> list[Path]:
    """Where a run's recorded ``model.path`` may be: itself (absolute, or relative to the current
    directory) and, when relative, relative to the directory the run was launched from."""
    where = Path(path)
    if where.is_absolute():
        return [where]
    launch = launch_dir_of(run)
    return [where] + ([launch / where] if launch is not None and (launch / where).resolve() != where.resolve() else [])


def recorded_source(ckpt: str | Path) -> tuple[str, Path | None]:
    """What the checkpoint records of the model it came from: (words for the error, that HF dir or None)."""
    ckpt = Path(ckpt)
    run = run_dir_of(ckpt)
    if run is not None and (run / "config.json").is_file():
        try:
            path = json.loads((run / "config.json").read_text())["model"]["path"]
        except (ValueError, KeyError, TypeError):
            return f"its run's {run / 'config.json'} is unreadable", None
        said = (f"it was saved by the run {run}, which started from model.path={path} "
                f"(recorded in {run / 'config.json'})")
        tried = model_path_candidates(path, run)
        found = next((c for c in tried if (c / "config.json").is_file()), None)
        if found is None:
            places = [str(tried[0].resolve())
                      + ("" if tried[0].is_absolute() else " (relative to the current directory)")]
            places += [f"{c} (relative to the directory the run was launched from)" for c in tried[1:]]
            return f"{said}, which does not exist here: no config.json in {' nor in '.join(places)}", None
        return said + (f", found at {found.resolve()}" if found != Path(path) else ""), found
    conversion = ckpt / "megarl_conversion.json"
    if conversion.is_file():
        try:
            source = json.loads(conversion.read_text()).get("from_hf", "?")
        except ValueError:
            source = "?"
        hf = ckpt / "hf"
        return (f"it was converted from {source} (recorded in {conversion})",
                hf if (hf / "config.json").is_file() else None)
    return "it records no source model", None


def _word(value) -> str:
    return "yes" if value is True else "no" if value is False else str(value)


def describe(arch: dict) -> str:
    return ", ".join(f"{k} {_word(v)}" for k, v in arch.items())


def check_same_model(ckpt: str | Path, hf_cfg: dict, model_name: str) -> None:
    """Raise ``ModelMismatch`` naming both models when the dist checkpoint ``ckpt`` does not hold the
    architecture of ``hf_cfg`` (called ``model_name`` in the message: 'model.path=DIR', '--hf-config DIR')."""
    ckpt = Path(ckpt)
    want = from_hf_config(hf_cfg)
    shapes = model_tensor_shapes(ckpt)
    refuse_value_head(ckpt, shapes)
    if "embedding.word_embeddings.weight" not in shapes:
        raise ModelMismatch(f"{ckpt}: the dist checkpoint holds no embedding.word_embeddings.weight; "
                            "not a megarl/megatron GPT model checkpoint")
    have = from_tensors(shapes)
    source, source_dir = recorded_source(ckpt)
    recorded = None
    if source_dir is not None:
        try:
            recorded = _with_config_math(json.loads((source_dir / "config.json").read_text()))
        except (ValueError, KeyError):
            recorded = None
    diffs = [k for k in have if have[k] != want[k]]
    if not diffs and recorded is not None:  # what the tensors cannot show: heads × head_dim split otherwise, RoPE, ...
        want = _with_config_math(hf_cfg)
        diffs, have = [k for k in want if recorded[k] != want[k]], recorded
    if diffs:
        differ = "; ".join(f"{k}: checkpoint {_word(have[k])}, model {_word(want[k])}" for k in diffs)
        rope = (" A RoPE change made on purpose (e.g. YaRN scaling for longer contexts): export with the checkpoint's "
                "own config (mcore-to-hf without --hf-config) and change the exported config.json."
                if diffs == ["RoPE"] else "")
        raise ModelMismatch(
            f"{ckpt} holds another model than {model_name} ({differ}); {source}. "
            f"The checkpoint's model: {describe(have)}. Use the model the checkpoint was saved from "
            f"({source_dir or 'see above'}), or another checkpoint.{rope}")

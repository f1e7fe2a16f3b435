"""The model a run trains against the config: its shape against the layout, its sequence length and attention
head size against the engine, and the checkpoint a resume continues from against both the model and the
algorithm."""

from __future__ import annotations

import json
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig, captures_routes, engine_route_limit, route_capture_limit
from megarl.config.validate.algo import needed_learners
from megarl.config.validate.layout import check_model_layout, divisors
from megarl.config.validate.limits import check_engine_head_size, cuda_available, vllm_route_output_problem
from megarl.models.hf_config import (
    check_sequence_length,
    is_dist_checkpoint,
    model_files_dir,
    num_experts,
    read_hf_config,
)

# Deferred imports below (each marked): torch comes with megarl.models.tiny and megarl.checkpoint; config errors and
# ``megarl plan`` on a login node stay instant without it.


def model_config(cfg: RunConfig) -> dict:
    """The HF config the run will use: the checkpoint's, or the tiny model's it will create."""
    path = model_files_dir(cfg.model.path) / "config.json"
    if path.is_file() or is_dist_checkpoint(cfg.model.path):  # (a dist checkpoint without hf/: read_hf_config says so)
        return read_hf_config(cfg.model.path)
    if cfg.model.make_tiny:
        from megarl.models.tiny import TinyShape, hf_config  # deferred: torch (see above)

        return hf_config(TinyShape(family=cfg.model.make_tiny), eos_id=1, pad_id=0)
    raise ConfigError(f"model.path: {cfg.model.path} holds no config.json (set model.make_tiny to create a tiny model)")


def check_model_fits(cfg: RunConfig, hf: dict, here: bool = True) -> None:
    """The layout, the sequence length and (``here``: on this machine's vLLM) the attention head size."""
    p = cfg.parallel
    check_model_layout(hf, p.tp, p.pp, p.ep, p.etp, p.vpp, model=cfg.model.path)
    check_recompute(cfg, hf)
    if num_experts(hf) and p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.tp={p.tp} on an MoE model needs parallel.sequence_parallel=true "
                          "(megatron-core refuses MoE + TP without it)")
    replay = cfg.algo.routing_replay
    if replay in ("rollout", "trainer") and not num_experts(hf):
        raise ConfigError(f"algo.routing_replay={replay}: {cfg.model.path} is a dense model (no experts to route to); "
                          "set 'none' or 'auto'")
    gpu = here and cuda_available()
    if replay == "rollout" and num_experts(hf) and (why := route_capture_limit(cfg, gpu)):
        raise ConfigError(f"algo.routing_replay=rollout: the engines cannot capture each token's routes with {why}; "
                          "set algo.routing_replay=trainer (R2: the trainer's own routes) or none")
    if gpu and captures_routes(cfg, num_experts(hf), gpu) and (why := vllm_route_output_problem()):
        raise ConfigError(f"algo.routing_replay={replay} captures the engines' routes through vLLM's route output "
                          f"on GPUs, which {why}; or set algo.routing_replay=none")
    if cfg.engine.max_model_len > hf.get("max_position_embeddings", cfg.engine.max_model_len):
        raise ConfigError(f"engine.max_model_len={cfg.engine.max_model_len} exceeds the model's "
                          f"max_position_embeddings ({hf['max_position_embeddings']})")
    try:
        check_sequence_length(hf, cfg.engine.max_model_len, f"{model_files_dir(cfg.model.path)}/config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if here:  # (the attention backends of this machine's vLLM build)
        check_engine_head_size(hf, f"{model_files_dir(cfg.model.path)}/config.json")


def routes_off_note(cfg: RunConfig, experts: int, gpu: bool, placement: str = "", engine_tp: int = 0) -> str:
    """The line said where ``algo.routing_replay=auto`` resolves to none on an MoE model because its engines cannot
    capture routes ('' elsewhere): the start's (``routing_replay_notes``) and ``megarl plan``'s, whose layout's
    ``placement`` and ``engine_tp`` stand for the config's."""
    why = engine_route_limit(placement or cfg.engine.placement, engine_tp or cfg.engine.tensor_parallel_size, gpu)
    if not (experts and why and cfg.algo.routing_replay == "auto"):
        return ""
    return (f"algo.routing_replay=auto resolves to none (no routing replay, no moe/* agreement metrics): the "
            f"engines cannot capture each token's routes with {why}; engine.tensor_parallel_size=1 captures them, "
            "algo.routing_replay=trainer replays the trainer's own (R2)")


def routing_replay_notes(cfg: RunConfig, hf: dict) -> list[str]:
    """``routes_off_note`` of the run on this machine's kind (CPU or GPUs), as a list of notes."""
    note = routes_off_note(cfg, num_experts(hf), cuda_available())
    return [note] if note else []


def check_recompute(cfg: RunConfig, hf: dict) -> None:
    """``trainer.recompute=full`` runs units of ``trainer.recompute_layers`` layers (megatron's method 'uniform'),
    which must tile each model chunk's layers: megatron would index past the chunk's last layer otherwise."""
    t, p = cfg.trainer, cfg.parallel
    chunk = hf["num_hidden_layers"] // (p.pp * p.vpp)
    if t.recompute == "full" and chunk % t.recompute_layers:
        raise ConfigError(f"trainer.recompute_layers={t.recompute_layers} must divide the layers of a model chunk "
                          f"under trainer.recompute=full: {hf['num_hidden_layers']} layers / (parallel.pp={p.pp} × "
                          f"parallel.vpp={p.vpp}) = {chunk}; valid: {divisors(chunk)}")


def check_start_checkpoint(cfg: RunConfig, hf: dict) -> None:
    """``model.path`` a megatron dist checkpoint (``hf-to-mcore``'s output): its tensors are of the model its
    ``hf/config.json`` describes (``checkpoint/identity.py``), so a checkpoint of another model, or one converted with
    another config, is refused before launch naming the file."""
    from megarl.checkpoint.identity import ModelMismatch, check_same_model  # deferred: torch (see above)

    path = Path(cfg.model.path)
    try:
        check_same_model(path, hf, f"its {model_files_dir(path) / 'config.json'}")
    except ModelMismatch as exc:
        raise ConfigError(f"model.path={cfg.model.path}: {exc}") from None
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"model.path={cfg.model.path}: not a readable megatron dist checkpoint ({exc})") from None


def validate_resume_model(cfg: RunConfig, hf: dict) -> None:
    """``train``, before launch: the checkpoint ``train.resume`` continues from holds ``model.path``'s
    architecture (``checkpoint/identity.py``); ConfigError naming both models otherwise."""
    from megarl.checkpoint.identity import ModelMismatch, check_same_model  # deferred: torch (see above)
    from megarl.checkpoint.run import resume_candidate  # deferred: torch (see above)

    step = resume_candidate(cfg.train.resume, cfg.train.run_dir)
    if step is None or not (step / "policy" / "metadata.json").is_file():
        return  # nothing to resume, or an incomplete save (the resume itself warns and takes the previous one)
    try:
        check_same_model(step / "policy", hf, f"model.path={cfg.model.path}")
    except ModelMismatch as exc:
        auto = cfg.train.resume == "auto"
        where = f" in train.run_dir={cfg.train.run_dir}" if auto else ""
        fresh = " (train.resume=never starts afresh, setting that run aside)" if auto else ""
        raise ConfigError(f"train.resume={cfg.train.resume}{where}: {exc}{fresh}") from None
    except (OSError, EOFError, RuntimeError):
        return  # an unreadable checkpoint: the resume verifies it and names the problem


def check_resume_precision(cfg: RunConfig) -> None:
    """``train``, before launch: the checkpoint ``train.resume`` continues from was saved in ``trainer.precision``
    (a bf16 run's optimizer holds fp32 main params that an fp32 run's has not, and the other way round); ConfigError
    naming both precisions and the ways out."""
    from megarl.checkpoint.dist import saved_precision  # deferred: torch (see above)
    from megarl.checkpoint.run import resume_candidate  # deferred: torch (see above)

    step = resume_candidate(cfg.train.resume, cfg.train.run_dir)
    if step is None or not (step / "policy" / "metadata.json").is_file():
        return
    saved = saved_precision(step / "policy")
    if saved and saved != cfg.trainer.precision:
        raise ConfigError(f"trainer.precision={cfg.trainer.precision}: the checkpoint {step} that train.resume="
                          f"{cfg.train.resume} continues from was saved with trainer.precision={saved}; resume with "
                          f"trainer.precision={saved}, or start afresh in it (train.resume=never, or another "
                          f"train.run_dir with model.path set to an HF export of that run)")


def check_resume_lora(cfg: RunConfig) -> None:
    """``train``, before launch: the checkpoint ``train.resume`` continues from holds the LoRA adapters ``lora.*``
    describes (rank and alpha; none at ``lora.rank`` 0): ConfigError naming both, where loading would refuse after
    the whole launch."""
    from megarl.checkpoint.dist import saved_lora  # deferred: torch (see above)
    from megarl.checkpoint.run import resume_candidate  # deferred: torch (see above)

    step = resume_candidate(cfg.train.resume, cfg.train.run_dir)
    if step is None or not (step / "policy" / "metadata.json").is_file():
        return
    saved, lo = saved_lora(step / "policy"), cfg.lora
    here = {"rank": lo.rank, "alpha": lo.alpha} if lo.rank > 0 else {}
    if (saved.get("rank"), saved.get("alpha")) != (here.get("rank"), here.get("alpha")):
        was = f"lora.rank={saved['rank']} lora.alpha={saved['alpha']:g}" if saved else "lora.rank=0 (no adapters)"
        raise ConfigError(f"lora.rank={lo.rank} lora.alpha={lo.alpha:g}: the checkpoint {step} that train.resume="
                          f"{cfg.train.resume} continues from was saved with {was}; resume with those, or start "
                          "afresh (train.resume=never, or another train.run_dir)")


def check_resume_learners(cfg: RunConfig) -> None:
    """``train``, before launch: the checkpoint ``train.resume`` continues from has a ``critic/`` and a
    ``reference/`` where the algorithm needs them (a GRPO run's checkpoints hold ``policy/`` alone, so
    resuming one with PPO, or with a KL penalty added, would fail after the whole launch); ConfigError
    naming the missing directory, the setting that needs it and the ways out."""
    from megarl.checkpoint.run import resume_candidate  # deferred: torch (see above)

    step = resume_candidate(cfg.train.resume, cfg.train.run_dir)
    if step is None or not (step / "policy" / "metadata.json").is_file():
        return  # nothing to resume, or an incomplete save (validate_resume_model's rule)
    needed = needed_learners(cfg.algo, cfg.lora.rank)
    missing = {n: why for n, why in needed.items() if not (step / n / "metadata.json").is_file()}
    # a trained critic the algorithm would not build: dropped, and in its own run dir the next saves rotate away the
    # last checkpoints that hold it (a reference is model.path's weights: nothing is lost without one)
    drops = "critic" not in needed and (step / "critic" / "metadata.json").is_file() and \
        step.parent.parent.resolve() == Path(cfg.train.run_dir).resolve()
    if not missing and not drops:
        return
    run_cfg = step.parent.parent / "config.json"
    try:
        saved = json.loads(run_cfg.read_text())["algo"]
        was = (f"; the run that saved it had algo.advantage={saved.get('advantage')}, "
               f"algo.kl_coef={saved.get('kl_coef')} (recorded in {run_cfg})")
        original = f"algo.advantage={saved.get('advantage')} algo.kl_coef={saved.get('kl_coef')}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        was, original = "", "the algorithm the run was started with"
    where = f"train.resume={cfg.train.resume}" + (f" in train.run_dir={cfg.train.run_dir}" if cfg.train.resume == "auto"
                                                  else "")
    preset = f" of algo.preset={cfg.algo.preset}" if cfg.algo.preset else ""
    if drops:
        raise ConfigError(f"{where}: the checkpoint {step} holds a trained critic/, which algo.advantage="
                          f"{cfg.algo.advantage}{preset} does not use{was}: resuming would drop it, and this run's "
                          "next saves would rotate away the last checkpoints that hold it. Resume with the original "
                          f"algorithm ({original}), or continue without the critic in another train.run_dir "
                          f"(train.resume={step} there keeps this run's checkpoints)")
    raise ConfigError(f"{where}: the checkpoint {step} has no "
                      f"{' and no '.join(f'{n}/ ({why})' for n, why in missing.items())}{preset}{was}. "
                      "Set train.resume=never to start afresh (the earlier run's checkpoints are set aside), "
                      f"use another train.run_dir, or resume with the original algorithm ({original})")

"""Weight sync into a bf16 vLLM replica in a process of its own (``engine.placement=disaggregated``).

    python tests/workers/bf16_replica_checks.py RUN_DIR          # the trainer and its replica
    python tests/workers/bf16_replica_checks.py --probe MODEL_DIR  # a fresh bf16 engine on MODEL_DIR's files

The trainer (``trainer.precision=bf16``) takes an optimizer step, streams its weights to the replica, and exports
them as an HF checkpoint. The replica's weights cannot be read from here, so they are compared through what they
compute: the replica's greedy tokens and logprobs on a probe equal, bit for bit, those of a fresh bf16 engine (the
same vLLM build, kernels and thread count, another process) started on the exported files, and differ from those
of one started on the model before the step. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

PROBE_SEED = 5


def probe_requests(vocab: int):
    import torch

    from megarl.types import GenerationRequest

    g = torch.Generator().manual_seed(PROBE_SEED)
    return [GenerationRequest(torch.randint(2, vocab, (6,), generator=g).tolist(), n=1, max_tokens=12, greedy=True)
            for _ in range(4)]


def probe(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine
    from megarl.models.hf_config import read_hf_config

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29641")
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.0625, seed=0, max_num_seqs=8, dtype="bfloat16")
    outs = engine.generate(probe_requests(read_hf_config(model_dir)["vocab_size"]), seed=0)
    print(json.dumps([[o[0].token_ids, o[0].logprobs] for o in outs]), flush=True)


def fresh_engine(model_dir: str) -> list:
    out = subprocess.run([sys.executable, __file__, "--probe", model_dir], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("[")][-1])


def main(run_dir: str) -> None:
    from helpers.trainers import fixed_batch, hf_weights
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config import load_config
    from megarl.convert.export import export_hf
    from megarl.session import build_session

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "model.make_tiny=qwen2",
        "engine.placement=disaggregated", "engine.replicas=1", "engine.kv_cache_gib=0.0625", "engine.slots=8",
        "trainer.precision=bf16", "data.eval_size=4", "optim.micro_batch_size=8", "sync.bucket_mib=0.25"])
    s = build_session(cfg)
    try:
        vocab = s.hf_cfg["vocab_size"]
        s.trainer.train_step(fixed_batch(vocab), lambda lp, mb: ppo_clip_loss(
            lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))
        metrics = s.weight_sync.run(s.engines, 1).metrics()
        replica = [[o[0].token_ids, o[0].logprobs] for o in s.engines.generate(probe_requests(vocab), seed=0)]
        export = export_hf(s.trainer, cfg.model.path, f"{run_dir}/export")
        params = sum(t.numel() for _, t in hf_weights(s.trainer))
        print(json.dumps({"sync_bytes": metrics["sync/bytes"], "params": params,
                          "version": min(s.engines.served_versions()), "replica_dtype": str(s.engines.dtype),
                          "equal_to_exported": replica == fresh_engine(str(export)),
                          "equal_to_original": replica == fresh_engine(cfg.model.path)}), flush=True)
    finally:
        s.engines.close()


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        probe(sys.argv[2])
    else:
        main(sys.argv[1])

"""The megatron-core trainer (one process) against HF transformers, family by family.

    python tests/workers/hf_parity_checks.py WORKDIR FAMILY [FAMILY ...]

For each family: a tiny checkpoint, the trainer's per-token logprobs of a fixed batch, unpacked and packed
(``trainer.packing``: rows of several lengths, grouped for attention; and a batch of rows of one length, which the
packed attention takes as it lies), and the logprobs transformers computes from the same checkpoint. Prints one
JSON line: {family: {gap, packed_gap, equal_packed_gap: max |difference|, scale: max |logprob|} over the loss
mask}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(work: str, *families: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from transformers import AutoModelForCausalLM

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.batch import build_batch
    from megarl.config.schema import OptimConfig
    from megarl.models.tiny import TinyShape, make_tiny_model

    gaps = {}
    for family in families:
        path = make_tiny_model(Path(work) / family, TinyShape(family=family, init_std=0.3), seed=7)
        _, cfg, trainer = build_trainer("single", str(path), OptimConfig(micro_batch_size=4))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

        def theirs(batch, hf=hf):
            with torch.no_grad():
                logits = hf(batch.input_ids).logits  # right-padded rows: causal attention needs no mask
            return torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)

        batch = fixed_batch(cfg["vocab_size"])
        equal = build_batch(*(batch.input_ids[:, i:j].tolist() for i, j in ((0, 5), (5, 14))))  # 13 positions each
        ours = trainer.logprobs(batch)
        trainer.packing = True
        packed, equal_packed = trainer.logprobs(batch), trainer.logprobs(equal)
        ref, mask = theirs(batch), batch.loss_mask
        gaps[family] = {"gap": float(((ours - ref).abs() * mask).max()), "scale": float((ref.abs() * mask).max()),
                        "packed_gap": float(((packed - ref).abs() * mask).max()),
                        "equal_packed_gap": float(((equal_packed - theirs(equal)).abs() * equal.loss_mask).max()),
                        "equal_rows": sorted(set(equal.row_lengths()))}
    print(json.dumps(gaps), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

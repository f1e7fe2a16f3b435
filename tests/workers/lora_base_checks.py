"""``convert.lora_base.ensure_lora_base`` in one process (megatron's conversion patches torch for CPU, so not inside
pytest's): a tiny model converted to a dist checkpoint, then a LoRA run's engine base made from it.

    python tests/workers/lora_base_checks.py HF_DIR WORK   (prints one JSON line)

Rank 1 (a thread here) waits until rank 0's conversion is complete; the base's weights are the HF model's bit for
bit; a second call reuses it (nothing rewritten), one without its completion mark converts again, and so does one
after the checkpoint was rewritten in place; the same run dir with another dist checkpoint is refused; a full run or
an HF model.path has none.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


def main(hf: str, work: str) -> None:
    from safetensors.torch import load_file

    from megarl.config import load_config
    from megarl.config.errors import ConfigError
    from megarl.convert.dist_hf import hf_to_mcore
    from megarl.convert.lora_base import SOURCE, engine_model_dir, engines_start_empty, ensure_lora_base

    work = Path(work)
    ckpt, other = work / "ckpt", work / "other"
    hf_to_mcore(hf, ckpt, log=lambda _: None)
    run = ["lora.rank=4", f"train.run_dir={work / 'run'}"]
    cfg = load_config(None, [f"model.path={ckpt}", *run])
    waited = {}
    peer = threading.Thread(target=lambda: waited.update(path=ensure_lora_base(cfg, rank=1, poll_s=0.05)))
    peer.start()
    base = ensure_lora_base(cfg, rank=0)
    peer.join(timeout=60)
    written = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    again = ensure_lora_base(cfg, rank=0)
    reused = again == base and written == {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    hf_weights = {k: v for f in sorted(Path(hf).glob("*.safetensors")) for k, v in load_file(f).items()}
    base_weights = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(f).items()}
    (base / SOURCE).unlink()  # a conversion cut short after its rename: converted again
    remade = ensure_lora_base(cfg, rank=0) == base and (base / SOURCE).is_file()
    meta = ckpt / "metadata.json"  # the checkpoint rewritten in place since: converted again
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))
    before = (base / SOURCE).stat().st_mtime_ns
    ensure_lora_base(cfg, rank=0)
    rewritten = (base / SOURCE).stat().st_mtime_ns != before and \
        json.loads((base / SOURCE).read_text())["files"]["metadata.json"][1] == meta.stat().st_mtime_ns
    hf_to_mcore(hf, other, log=lambda _: None)
    try:
        ensure_lora_base(load_config(None, [f"model.path={other}", *run]), rank=0)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    print(json.dumps({
        "base": str(base), "peer_got": str(waited.get("path")), "source": json.loads((base / SOURCE).read_text()),
        "engine_dir": str(engine_model_dir(cfg)), "starts_empty": engines_start_empty(cfg),
        "same_weights": hf_weights.keys() == base_weights.keys() and all(
            hf_weights[k].dtype == base_weights[k].dtype and bool((hf_weights[k] == base_weights[k]).all())
            for k in hf_weights),
        "tokenizer": (base / "tokenizer_config.json").is_file(),
        "reused": reused,
        "remade": remade, "rewritten": rewritten,
        "refused": refused,
        "full_run": [str(engine_model_dir(load_config(None, [f"model.path={ckpt}"]))),
                     engines_start_empty(load_config(None, [f"model.path={ckpt}"]))],
        "hf_run": ensure_lora_base(load_config(None, [f"model.path={hf}", *run]), rank=0) is None,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""End to end (slow: two tiny runs): a reward that fails on every call stops the run with its traceback and a
non-requeue exit; a dataset run without ``data.eval_path`` says once why it does not evaluate and logs no NaN;
a dataset that runs out of usable rows mid-run is a data error, not an engine fault (no restart, no exit 75)."""

import json
import os
import subprocess
import sys

import pytest

from helpers.scripts import ROOT, run_script

CONFIG = """\
model: {{path: {work}/model, make_tiny: qwen2}}
data: {{path: {work}/train.jsonl, max_prompt_tokens: 48}}
reward: {{fn: "mine:raises", workers: 1, timeout_s: 20, max_failed_steps: 2}}
rollout: {{prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 8}}
engine: {{max_model_len: 64, kv_cache_gib: 0.125, slots: 8}}
optim: {{micro_batch_size: 4}}
train: {{steps: 5, run_dir: {work}/run, save_every: 0}}
"""


@pytest.mark.slow
def test_failing_reward_stops_without_requeue_and_no_eval_path_is_said_once(tmp_path):
    rows = [{"prompt": f"Reverse: word{i}", "answer": f"{i}drow", "level": i % 3} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"prompt": "", "answer": "x"}) + "\n" for _ in range(16)))
    (tmp_path / "mine.py").write_text("def raises(response, answer, **row):\n"
                                      "    raise ValueError('my verifier blew up')\n")
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(work=tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    assert "every reward call failed in the last 2 steps (reward.max_failed_steps)" in proc.stderr
    assert out.count("Traceback") == 1 and 'mine.py", line 2, in raises' in out and "my verifier blew up" in out
    assert out.count("evaluation skipped: megarl eval needs data.eval_path") == 1
    assert "pass@1" not in out and "nan" not in out.lower().replace("nanoseconds", "")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("eval/pass_at_1" not in r for r in records)
    assert records[-1]["reward/errors"] == 8.0

    got = run_script([str(ROOT / "tests" / "workers" / "data_fault_checks.py"), str(config), str(tmp_path)])
    assert got["error"] and not got["requeue"] and got["steps"] == 0, got
    assert got["engine_errors"] == 0 and got["restarts"] == 0, got
    assert "data error (not an engine fault, not requeued)" in got["stopped"]
    assert "bad.jsonl': none of its 16 rows is usable (16 bad, 0 longer" in got["stopped"], got

"""The real SmolLM2-135M-Instruct in multi-turn episodes (``examples/smollm2/multiturn.yaml``: the ``Feedback``
environment): one phase's trajectories against the model's own chat template, then two RL steps.

    python tests/workers/smollm2_episodes.py MODEL_DIR DATA_DIR RUN_DIR

Prints one JSON line: per sample of the phase, its turns and whether its trajectory is what the template renders
(see ``check``); then the two steps' metrics and the held-out evaluation's figures (8 prompts, greedy episodes).
"""

from __future__ import annotations

import json
import math
import sys


def check(s, prompt_messages: list[dict], tok, feedback: str) -> dict:
    """A trajectory against SmolLM2's template: its text is the template's rendering of the whole conversation; each
    feedback message's tokens are the template's text for it (less the ``<|im_end|>`` the model sampled), encoded
    alone; each model turn ends with the EOS it sampled and carries a behaviour logprob per token, the feedback
    none (0.0)."""
    from megarl.rollout.turns import transcript

    messages = transcript(s, tok)
    conversation = prompt_messages + messages  # (the template adds its own system turn when none leads)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    text = tok.decode(s.prompt_ids + s.response_ids)
    env_rendered, model_ok = [], []
    for k, (role, ids) in enumerate(s.segments()):
        if role == "env":
            before = conversation[:len(prompt_messages) + k]
            base = tok.apply_chat_template(before, tokenize=False)
            full = tok.apply_chat_template(before + [messages[k]], tokenize=False, add_generation_prompt=True)
            # after the model's sampled <|im_end|>: the template's '\n', then the message and the next header
            env_rendered.append(ids == tok("\n" + full[len(base):], add_special_tokens=False)["input_ids"] and
                                messages[k] == {"role": "user", "content": feedback})
        elif k < len(s.segments()) - 1 or s.finish_reason == "stop":
            model_ok.append(bool(ids) and ids[-1] == tok.eos_token_id)
    spans, at = s.env_spans + [(len(s.response_ids), len(s.response_ids))], 0
    for a, b in spans:  # sampled tokens: a behaviour logprob each; the feedback's: none
        model_ok.append(all(math.isfinite(lp) and lp <= 0.0 for lp in s.logprobs[at:a]))
        model_ok.append(all(lp == 0.0 for lp in s.logprobs[a:b]))
        at = b
    return {"turns": s.turns, "finish": s.finish_reason, "text_is_template": text == (
        whole.removesuffix("\n") if s.finish_reason == "stop" else text),
        "env_rendered": env_rendered, "model_ok": all(model_ok), "reward": s.reward,
        "len_ok": len(s.logprobs) == len(s.response_ids) == len(s.versions)}


def main(model_dir: str, data_dir: str, run_dir: str) -> None:
    from megarl.config import load_config
    from megarl.rollout.evaluate import pass_rates
    from megarl.session import build_session
    from megarl.train import rl_step

    sys.path.insert(0, ".")
    from examples.smollm2.feedback import FEEDBACK

    cfg = load_config("examples/smollm2/multiturn.yaml", [
        f"model.path={model_dir}", f"data.path={data_dir}/train.jsonl", f"data.eval_path={data_dir}/test.jsonl",
        f"train.run_dir={run_dir}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "optim.micro_batch_size=8", "data.eval_size=8", "env.max_turns=3"])
    s = build_session(cfg)
    rows = {json.dumps(r["prompt"][-1]["content"]): r["prompt"]
            for r in map(json.loads, open(f"{data_dir}/train.jsonl"))}
    groups, _ = s.controller.run_phase(s.policy_version)
    samples = []
    for g in groups:
        prompt = rows[json.dumps(g.prompt_text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0])]
        samples += [check(x, prompt, s.tokenizer, FEEDBACK) for x in g.samples]
    steps = [rl_step(s, step) for step in range(2)]
    evaluation = pass_rates(s.engines, s.tokenizer, s.eval_prompts, s.rewards, cfg.rollout.max_new_tokens,
                            episodes=s.eval_episodes)  # (the run's own held-out evaluation: greedy episodes)
    s.close()
    print(json.dumps({"samples": samples, "steps": [{k: v for k, v in m.items() if isinstance(v, (int, float))}
                                                    for m in steps], "eval": evaluation}))


if __name__ == "__main__":
    main(*sys.argv[1:4])

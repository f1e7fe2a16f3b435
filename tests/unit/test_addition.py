import random
from collections import Counter

from megarl.data.addition import AdditionTask, Problem, extract_answer, sample_problem, scratchpad
from megarl.rewards.base import load_reward_fn
from megarl.rewards.builtin import addition_reward as exact_answer


def test_scratchpad_walks_columns_with_carries():
    assert scratchpad(4073, 958) == "3+8+0=11,7+5+1=13,0+9+1=10,4+0+1=05>5031"
    assert scratchpad(5, 7) == "5+7+0=12>12"
    assert scratchpad(0, 0) == "0+0+0=00>0"


def test_scratchpad_answer_is_the_sum_for_random_operands():
    rng = random.Random(3)
    for _ in range(500):
        a, b = rng.randint(0, 10**7), rng.randint(0, 10**7)
        assert extract_answer(scratchpad(a, b)) == str(a + b)


def test_reward_is_exact_final_answer_only():
    p = Problem(4073, 958)
    assert exact_answer(p.response, p.answer) == 1.0
    assert exact_answer("3+8+0=11>5032", p.answer) == 0.0
    assert exact_answer("no answer here", p.answer) == 0.0
    assert exact_answer(">5031 ", p.answer) == 1.0


def test_operand_sizes_are_heavy_tailed():
    rng = random.Random(0)
    sizes = Counter(max(len(str(p.a)), len(str(p.b))) for p in (sample_problem(rng, 6, 1.0) for _ in range(4000)))
    assert sizes[1] + sizes[2] > sizes[5] + sizes[6]  # most problems short
    assert sizes[6] > 0  # a tail of long ones
    lengths = [len(scratchpad(10**5, 10**5)), len(scratchpad(1, 1))]
    assert lengths[0] > 4 * lengths[1]  # response lengths vary several-fold


def test_eval_set_is_held_out_and_stream_is_reproducible():
    task = AdditionTask(max_digits=3, tail_alpha=1.0, seed=5, eval_size=50)
    assert len(task.eval_problems) == 50
    train = task.next_problems(2000)
    assert not set(train) & set(task.eval_problems)
    again = AdditionTask(max_digits=3, tail_alpha=1.0, seed=5, eval_size=50)
    again.skip_to(task.cursor - 10)
    tail = [p for p in (again.next_problem() for _ in range(20)) if again.cursor <= task.cursor]
    assert tail == train[-len(tail):]


def test_reward_fn_by_dotted_path():
    assert load_reward_fn("megarl.rewards.builtin:addition_reward") is exact_answer
    for bad in ("megarl.rewards.builtin", "no_such_module:f", "megarl.rewards.builtin:nope"):
        try:
            load_reward_fn(bad)
        except ValueError as exc:
            assert bad.split(":")[0] in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


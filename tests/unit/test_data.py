"""Prompt datasets: every format yields the same prompts; chat rendering; bad rows; errors; the cursor."""

import json
import logging

import pytest

from megarl.config.schema import DataConfig
from megarl.data.chat import PromptRenderer
from megarl.data.checks import check_data
from megarl.data.readers import RowStore
from megarl.data.rows import DataError
from megarl.data.source import DatasetSource, build_prompts
from megarl.models.tiny import build_tokenizer

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i}/{i + 1} + 1?"}],
         "answer": rf"\frac{{{2 * i + 1}}}{{{i + 1}}}", "level": i % 3, "source": "synthetic"} for i in range(12)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def drain(source, n):
    return [(p.text, p.ids, p.answer, p.extras) for p in (source.next() for _ in range(n))]


def source_for(tok, spec, **kw):
    return DatasetSource(RowStore(spec), PromptRenderer(tok, "auto", kw.pop("system", "")), **kw)


def test_every_format_yields_the_same_prompts(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "all.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "all.parquet", row_group_size=5)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "parts").mkdir()
    write_jsonl(tmp_path / "parts" / "a.jsonl", ROWS[:7])
    pq.write_table(pa.Table.from_pylist(ROWS[7:]), tmp_path / "parts" / "b.parquet")
    specs = [tmp_path / "all.jsonl", tmp_path / "all.parquet", tmp_path / "hf", tmp_path / "parts",
             str(tmp_path / "parts" / "*")]
    for shuffle in (False, True):
        results = [drain(source_for(tok, str(s), shuffle=shuffle, seed=3), 30) for s in specs]
        for spec, got in zip(specs[1:], results[1:]):
            assert got == results[0], spec
    in_order = results[0] if not shuffle else drain(source_for(tok, str(specs[0]), shuffle=False), 12)
    assert [a for _, _, a, _ in in_order] == [r["answer"] for r in ROWS]
    assert in_order[0][3] == {"level": 0, "source": "synthetic"}


def test_chat_prompts_render_to_the_ids_of_apply_chat_template(tmp_path, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r"Simplify \frac{2}{4}."}]
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs, "answer": "1/2"}, {"prompt": "Plain 12+7?", "answer": "19"}])
    src = source_for(tok, str(tmp_path / "d.jsonl"), shuffle=False, system="You are a helpful assistant.")
    chat, plain = src.next(), src.next()
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat.ids == want and chat.text.endswith("<|im_start|>assistant\n")
    sys_plain = [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "Plain 12+7?"}]
    assert plain.ids == tok.apply_chat_template(sys_plain, add_generation_prompt=True, tokenize=True)["input_ids"]
    raw = DatasetSource(RowStore(str(tmp_path / "d.jsonl")), PromptRenderer(tok, "none"), shuffle=False)
    raw.next()
    assert raw.next().ids == tok("Plain 12+7?", add_special_tokens=False)["input_ids"]
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}=>")
    custom = DatasetSource(RowStore(str(tmp_path / "d.jsonl")), PromptRenderer(tok, str(tmp_path / "t.jinja")),
                           shuffle=False)
    assert custom.next().text == r"[Be brief.][Simplify \frac{2}{4}.]=>"


BAD = ['{"prompt": "ok 1", "answer": "1"}', "{not json", '{"prompt": "no answer"}', '{"prompt": 7, "answer": "2"}',
       '{"prompt": [{"role": "user"}], "answer": "3"}', '[1, 2]', '{"prompt": "ok 2", "answer": 5}']


def test_bad_rows_skip_counts_and_logs_with_line(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [], BAD)
    src = source_for(tok, str(path), shuffle=False)
    with caplog.at_level(logging.WARNING):
        got = [src.next() for _ in range(4)]
    assert [p.answer for p in got] == ["1", "5", "1", "5"]
    assert src.metrics()["data/bad_rows"] == 10  # 5 bad rows, seen in each of two epochs
    assert src.metrics()["data/epoch"] == 2.0  # two full passes
    assert f"{path}:line 2" in caplog.text and "not valid JSON" in caplog.text and "line 3" in caplog.text
    assert caplog.text.count("skipping bad row") == 5  # logged once per row, not per epoch


@pytest.mark.parametrize("line,where,words", [
    (BAD[1], "line 2", "not valid JSON"), (BAD[2], "line 2", "'answer'"), (BAD[3], "line 2", "'prompt'"),
    (BAD[4], "line 2", "message 0"), (BAD[5], "line 2", "not an object")])
def test_bad_rows_error_mode_names_file_line_and_field(tmp_path, tok, line, where, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [], [BAD[0], line])
    with pytest.raises(DataError, match=words) as info:
        source_for(tok, str(path), on_bad_row="error")
    assert f"{path}:{where}" in str(info.value)
    d = DataConfig(path=str(path), on_bad_row="error")
    with pytest.raises(DataError, match=words):  # the same, before any process starts
        check_data(d)


def test_a_line_that_is_not_utf8_is_a_bad_row_saying_so(tmp_path, tok):
    """Junk bytes were reported as a UTF-16 decode error (json.loads guessed the codec from them); a UTF-8 BOM on
    the first line (Windows editors) is read, not refused."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "bom", "answer": "1"}\n\xff\xfe{"prompt": "x"}\n'
                     b'{"prompt": "ok", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"line 2: not UTF-8 text \(byte 1 of the line: b'\\xff\\xfe") as info:
        check_data(DataConfig(path=str(path), on_bad_row="error"))
    assert "utf-16" not in str(info.value) and "line 1" not in str(info.value) and "1 more" not in str(info.value)
    src = source_for(tok, str(path), shuffle=False)
    assert [src.next().answer for _ in range(2)] == ["1", "2"] and src.metrics()["data/bad_rows"] == 1


def test_bad_rows_error_mode_names_every_bad_row_up_to_ten_and_counts_the_rest(tmp_path):
    """A file with several bad rows took one fix-and-rerun round per row (only the first was named)."""
    path = write_jsonl(tmp_path / "bad.jsonl", [], [BAD[0]] + [BAD[2]] * 3 + [BAD[0]] + [BAD[1]] * 10)
    with pytest.raises(DataError, match=r"^13 bad rows \(data.on_bad_row=error\): ") as info:
        check_data(DataConfig(path=str(path), on_bad_row="error"))
    text = str(info.value)
    assert all(f"{path}:line {n}:" in text for n in (2, 3, 4, 6, 7, 8, 9, 10, 11, 12))
    assert f"{path}:line 13" not in text and text.endswith("; 3 more")


def test_missing_key_empty_dataset_and_missing_file_are_clear_errors(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    with pytest.raises(DataError, match="no row has the key 'question'.*data.prompt_key"):
        check_data(DataConfig(path=str(path), prompt_key="question"))
    with pytest.raises(DataError, match="'solution'.*data.answer_key"):
        check_data(DataConfig(path=str(path), answer_key="solution"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        check_data(DataConfig(path=str(tmp_path / "empty.jsonl")))
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_data(DataConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(FileNotFoundError, match="glob matches no"):
        check_data(DataConfig(path=str(tmp_path / "*.parquet")))
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        (tmp_path / "d.csv").write_text("a,b\n")
        check_data(DataConfig(path=str(tmp_path / "d.csv")))
    other = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "p", "solution": "1"}])
    with pytest.raises(DataError, match="data.eval_path=.*'answer'"):
        check_data(DataConfig(path=str(path), eval_path=str(other)))


def test_a_held_out_set_in_another_layout_has_keys_of_its_own(tmp_path, tok):
    """Training on one layout and evaluating on a benchmark in another (MATH-style problem/solution): the error
    told the user to change data.answer_key, which the training file needs as it is."""
    train = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": f"{i}+{i}?", "solution": str(2 * i)} for i in range(3)])
    with pytest.raises(DataError, match=r"data.eval_path=.*no row has the key 'prompt' \(data.prompt_key\); set "
                                        r"data.eval_prompt_key to the column that holds it \(the held-out set's own; "
                                        r"data.prompt_key stays data.path's\).*problem, solution"):
        check_data(DataConfig(path=str(train), eval_path=str(bench)))
    d = DataConfig(path=str(train), eval_path=str(bench), eval_prompt_key="problem", eval_answer_key="solution")
    check_data(d)
    src = build_prompts(d, tok)
    assert [(p.text.count("1+1?"), p.answer) for p in src.eval_prompts()][1] == (1, "2")
    assert src.next().answer in {r["answer"] for r in ROWS[:3]}  # the training set still read with its own keys
    with pytest.raises(DataError, match=r"'answer' \(data.eval_answer_key\); set data.eval_answer_key"):
        check_data(DataConfig(path=str(train), eval_path=str(bench), eval_prompt_key="problem",
                              eval_answer_key="answer"))


def test_cursor_epochs_and_state_round_trip(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = source_for(tok, str(path), seed=7)
    first_epoch = drain(a, 12)
    assert sorted(x[2] for x in first_epoch) == sorted(r["answer"] for r in ROWS)  # each row once per epoch
    assert [x[2] for x in first_epoch] != [r["answer"] for r in ROWS]  # shuffled
    drain(a, 5)
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint stores
    b = source_for(tok, str(path), seed=7)
    b.load_state_dict(state)
    assert drain(b, 20) == drain(a, 20)  # across the next epoch boundary too
    assert a.metrics()["data/epoch"] == pytest.approx(37 / 12)
    second = source_for(tok, str(path), seed=7)
    drain(second, 12)
    assert [x[2] for x in drain(second, 12)] != [x[2] for x in first_epoch]  # a new order each epoch
    with pytest.raises(DataError, match="seed"):
        source_for(tok, str(path), seed=8).load_state_dict(state)


def test_long_prompts_dropped_and_counted_and_eval_rows(tmp_path, tok):
    rows = [{"prompt": "x " * (50 if i % 2 else 2), "answer": str(i)} for i in range(6)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    d = DataConfig(path=str(path), eval_path=str(path), shuffle=False, max_prompt_tokens=30, eval_size=2)
    src = build_prompts(d, tok)
    assert [src.next().answer for _ in range(3)] == ["0", "2", "4"]
    assert src.metrics()["data/prompts_too_long"] == 2
    assert [p.answer for p in src.eval_prompts()] == ["0", "2"]


def test_addition_task_is_a_source_with_the_same_interface(tok):
    from megarl.data.addition import AdditionTask
    from megarl.data.source import AdditionSource

    a = build_prompts(DataConfig(), tok, AdditionTask(4, 1.0, seed=2, eval_size=5))
    assert isinstance(a, AdditionSource) and len(a.eval_prompts()) == 5
    drain(a, 7)
    state = json.loads(json.dumps(a.state_dict()))
    b = AdditionSource(AdditionTask(4, 1.0, seed=2, eval_size=5), tok)
    b.load_state_dict(state)
    nxt = drain(a, 5)
    assert drain(b, 5) == nxt
    assert nxt[0][1] == tok(nxt[0][0], add_special_tokens=False)["input_ids"]  # raw completions, not chat-wrapped


def test_plain_text_prompts_start_with_bos_where_the_tokenizer_adds_one(tmp_path):
    """Without a chat template, a Llama/Gemma-style tokenizer (a BOS post-processor) encodes a text with BOS first,
    as vLLM does for a text prompt; prompts were encoded without it (both engine and trainer, so no check saw it)."""
    from tokenizers.processors import TemplateProcessing

    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"bos_token": "<|reserved_0|>"})
    bos = tok.bos_token_id
    plain = PromptRenderer(tok, "none")
    assert plain("What is 2+2?")[1][:1] != [bos]  # no post-processor: nothing added
    tok._tokenizer.post_processor = TemplateProcessing(single="<|reserved_0|> $A",
                                                       special_tokens=[("<|reserved_0|>", bos)])
    text, ids = PromptRenderer(tok, "none")("What is 2+2?")
    assert (ids[0] == bos and ids.count(bos) == 1
            and ids[1:] == tok("What is 2+2?", add_special_tokens=False)["input_ids"])
    chat = PromptRenderer(tok, "auto")([{"role": "user", "content": "hi"}])[1]
    assert bos not in chat  # the ChatML template writes no BOS; nothing is added to a rendered template

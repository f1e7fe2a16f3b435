"""verl's and TRL's dataset layouts as they are written, and datasets no row of which is usable.

verl: a parquet written by pyarrow with ``data_source, prompt (list of {role, content}), ability,
reward_model {style, ground_truth}, extra_info`` read with ``data.answer_key=reward_model.ground_truth``;
TRL: a conversational ``messages`` jsonl read with ``prompt_key = answer_key = messages``. A dataset with no
usable row (every row bad, or every prompt over the limit) is refused before launch (``megarl`` exit 2), and the
run's own detection counts one walk over the rows, however often it is retried."""

import json
import sys

import pytest

from megarl.cli import main as megarl
from megarl.data.chat import PromptRenderer
from megarl.data.checks import SAMPLE_ROWS, check_keys, check_usable
from megarl.data.readers import RowStore
from megarl.data.rows import DataError, Keys
from megarl.data.source import DatasetSource
from megarl.models.tiny import build_tokenizer

VERL = [{"data_source": "openai/gsm8k",
         "prompt": [{"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": f"What is {i} + {i}?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
         "extra_info": {"split": "train", "index": i}} for i in range(6)]
TRL = [{"messages": [{"role": "user", "content": f"Reverse: ab{i}"}, {"role": "assistant", "content": f"{i}ba"}]}
       for i in range(5)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def verl_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(VERL)
    assert pa.types.is_struct(table.schema.field("reward_model").type)  # verl's real layout: a struct column
    pq.write_table(table, path)
    return str(path)


def test_verl_parquet_reads_the_nested_ground_truth_and_keeps_the_other_columns(tmp_path, tok):
    spec = verl_parquet(tmp_path / "train.parquet")
    store = RowStore(spec)
    check_keys(store, Keys("prompt", "reward_model.ground_truth"))
    render = PromptRenderer(tok, "auto")
    src = DatasetSource(store, render, Keys("prompt", "reward_model.ground_truth"), shuffle=False)
    got = [src.next() for _ in range(6)]
    assert [p.answer for p in got] == [str(2 * i) for i in range(6)]
    assert got[1].ids == render(VERL[1]["prompt"])[1] and "Think step by step." in got[1].text
    assert got[1].extras == {"data_source": "openai/gsm8k", "ability": "math",
                             "reward_model": {"style": "rule", "ground_truth": "2"},
                             "extra_info": {"split": "train", "index": 1}}
    with pytest.raises(DataError, match=r"no row has the key 'reward_model.answer' .*the rows have: ability, "
                                        r"data_source, extra_info, extra_info.index, extra_info.split, prompt, "
                                        r"reward_model, reward_model.ground_truth, reward_model.style"):
        check_keys(store, Keys("prompt", "reward_model.answer"))
    with pytest.raises(DataError, match="row 0: field 'reward_model' .*must be a string or number.*dotted key: "
                                        "'reward_model.style', 'reward_model.ground_truth'"):
        DatasetSource(store, render, Keys("prompt", "reward_model"), on_bad_row="error")


def test_trl_conversation_prompt_is_before_the_last_assistant_turn_which_is_the_answer(tmp_path, tok):
    rows = TRL + [{"messages": [{"role": "user", "content": "no answer here"}]}]
    store = RowStore(write_jsonl(tmp_path / "chat.jsonl", rows))
    check_keys(store, Keys("messages", "messages"))
    render = PromptRenderer(tok, "auto")
    src = DatasetSource(store, render, Keys("messages", "messages"), shuffle=False)
    got = [src.next() for _ in range(6)]  # the sixth row has no assistant turn: skipped and counted
    assert [p.answer for p in got[:5]] == [f"{i}ba" for i in range(5)] and got[5].answer == "0ba"
    assert got[2].ids == render(TRL[2]["messages"][:1])[1] and "2ba" not in got[2].text
    assert got[0].extras == {} and src.bad_rows == 1
    with pytest.raises(DataError, match=r"chat.jsonl:line 6: field 'messages' .*assistant turn"):
        DatasetSource(store, render, Keys("messages", "messages"), on_bad_row="error")
    with pytest.raises(DataError, match=r"no row has the key 'solution' .*the rows have: messages$"):
        check_keys(store, Keys("messages", "solution"))


def test_a_conversation_beside_an_answer_column_loses_its_reference_turn_and_empty_messages_are_bad(tmp_path, tok,
                                                                                                     caplog):
    """OpenAI/TRL ``messages`` ending with the assistant's answer, plus a ``solution`` column: the prompt handed the
    policy its own reference answer. A conversation whose only message is empty was a usable prompt."""
    rows = [{**r, "solution": r["messages"][-1]["content"]} for r in TRL]
    rows.append({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": " "}], "solution": "1"})
    store = RowStore(write_jsonl(tmp_path / "chat.jsonl", rows))
    render = PromptRenderer(tok, "auto")
    with caplog.at_level("WARNING"):
        src = DatasetSource(store, render, Keys("messages", "solution"), shuffle=False)
        got = [src.next() for _ in range(6)]
    assert [p.answer for p in got[:5]] == [f"{i}ba" for i in range(5)]
    assert got[2].ids == render(TRL[2]["messages"][:1])[1] and "2ba" not in got[2].text
    assert src.bad_rows == 1 and "every other message is empty" in src.last_refusal
    assert sum("end with an assistant turn" in r.message for r in caplog.records) == 1  # said once


def test_a_source_with_no_usable_row_counts_one_walk_however_often_it_is_asked(tmp_path, tok):
    store = RowStore(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "answer": {"x": 1}}] * 64))
    src = DatasetSource(store, PromptRenderer(tok, "auto"), shuffle=True)
    for _ in range(3):  # the keeper used to retry the phase; each message must say the same
        with pytest.raises(DataError, match=r"bad.jsonl': none of its 64 rows is usable \(64 bad, 0 longer"):
            src.next()


def test_no_usable_row_in_a_sample_is_refused_naming_file_key_rows_and_why(tmp_path, tok):
    render = PromptRenderer(tok, "auto")
    rows = [{"prompt": f"What is {i} plus {i} in words, please?", "answer": str(i), "level": i} for i in range(300)]
    store = RowStore(write_jsonl(tmp_path / "long.jsonl", rows))
    with pytest.raises(DataError, match=rf"data.path='.*long.jsonl': no usable row: read {SAMPLE_ROWS} rows spread "
                                        rf"over its 300, refused every one: {SAMPLE_ROWS} longer than "
                                        r"data.max_prompt_tokens=4 tokens \(the shortest has \d+"):
        check_usable(store, "data.path", Keys(), render, 4)
    assert check_usable(store, "data.path", Keys(), render, 0) == {"level": 0}
    mixed = RowStore(write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "", "answer": "1"}, {"prompt": "q"}]))
    with pytest.raises(DataError, match=r"data.eval_path='.*mixed.jsonl': no usable row: read all 2 rows, refused "
                                        r"every one: 2 bad \(first: .*mixed.jsonl:line 1: field 'prompt' is an empty"):
        check_usable(mixed, "data.eval_path", Keys(), render, 0)


def test_megarl_refuses_an_unusable_dataset_or_reward_before_launch(tmp_path, tok, capsys, monkeypatch):
    """Exit 2 from ``megarl train`` itself (in this process, so nothing can have launched)."""
    model = tmp_path / "model"
    tok.save_pretrained(model)  # the tokenizer the run will render with (the tiny model is made at launch)
    rows = [{"prompt": f"Reverse the word number {i}, please", "answer": str(i), "difficulty": i} for i in range(8)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "rw.py").write_text("def narrow(response):\n    return 1.0\n"
                                              "def good(response, answer, **row):\n    return 1.0\n"
                                              "def keyed(response, answer, difficulty):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    base = ["train", f"model.path={model}", "model.make_tiny=qwen2", f"data.path={data}", f"data.eval_path={data}",
            f"train.run_dir={tmp_path}/run", "reward.fn=mine.rw:good"]

    def refused(*over: str) -> str:
        assert megarl([*base, *over]) == 2
        return capsys.readouterr().err

    err = refused("data.max_prompt_tokens=5")
    assert "data.eval_path=" in err and "train.jsonl': no usable row: read all 8 rows" in err and "longer than" in err
    err = refused("reward.fn=mine.rw:narrow")
    assert "reward.fn='mine.rw:narrow': def narrow(response) cannot be called" in err and "(difficulty)" in err
    # a held-out set in another layout hands the reward its own columns: checked too (only data.path's were)
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "Reverse 12", "solution": "21", "topic": "words"}])
    err = refused("reward.fn=mine.rw:keyed", f"data.eval_path={bench}", "data.eval_prompt_key=problem",
                  "data.eval_answer_key=solution")
    assert f"data.eval_path='{bench}': reward.fn='mine.rw:keyed'" in err and "(topic)" in err, err
    monkeypatch.chdir(tmp_path / "mine")  # the module is looked for from the working directory
    for name in ("mine.rw", "mine"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    err = refused()
    assert "cannot import 'mine.rw'" in err and f"working directory (here {tmp_path / 'mine'})" in err
    assert "PYTHONPATH" in err


def test_a_data_path_that_takes_in_the_held_out_file_is_refused(tmp_path, caplog):
    """data.path a directory holding train.jsonl and the test.jsonl that data.eval_path names: the run trained on
    its evaluation prompts, silently."""
    from megarl.config.schema import DataConfig
    from megarl.data.checks import check_data

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    held = write_jsonl(tmp_path / "test.jsonl", rows)
    with pytest.raises(DataError, match=rf"data.path='{tmp_path}' takes in the held-out file\(s\) of data.eval_path="
                                        rf"'{held}': {held}; the run would train on its evaluation prompts"):
        check_data(DataConfig(path=str(tmp_path), eval_path=held))
    assert set(check_data(DataConfig(path=str(tmp_path / "train*.jsonl"), eval_path=held))) == {"data.path",
                                                                                               "data.eval_path"}
    with caplog.at_level("WARNING"):  # the same file, given twice (here once through a symlink): meant, and said
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "link.jsonl").symlink_to(held)
        check_data(DataConfig(path=str(tmp_path / "sub" / "link.jsonl"), eval_path=held))
    assert any("the held-out prompts are trained on" in r.message for r in caplog.records)
    with pytest.raises(DataError, match="takes in the held-out file"):  # a directory for both: not one file
        check_data(DataConfig(path=str(tmp_path), eval_path=str(tmp_path)))
    # megarl eval trains nothing: the same config evaluates (it was refused as if it would train)
    assert set(check_data(DataConfig(path=str(tmp_path), eval_path=held), training=False)) == {"data.path",
                                                                                              "data.eval_path"}

"""Data loaders: every real file in ../shared/data, and bad files naming file and row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from toolenv.tasks.data import DataError, Example, load_examples

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"real data folder {DATA} not present (only in the project workspace)"
)

# (file, rows in the README table, kind of every row or None for a mix)
REAL = [
    ("gsm8k_test.jsonl", 1319, "math"),
    ("math500_test.jsonl", 500, "math"),
    ("hotpotqa_test.jsonl", 200, "qa"),
    ("bamboogle_test.jsonl", 125, "qa"),
    ("arpo_rl_valid.parquet", 180, None),
]


@needs_data
@pytest.mark.parametrize(("name", "rows", "kind"), REAL)
def test_real_file_counts_and_kinds(name, rows, kind):
    examples = load_examples(DATA / name)
    assert len(examples) == rows
    assert all(isinstance(e, Example) and e.question.strip() and e.answers for e in examples)
    assert len({e.id for e in examples}) == rows, "ids must be unique"
    if kind:
        assert {e.kind for e in examples} == {kind}


@needs_data
def test_gsm8k_final_answer_after_hashes():
    examples = load_examples(DATA / "gsm8k_test.jsonl")
    assert examples[0].answers == ["18"]  # "... #### 18"
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", e.answers[0]) for e in examples)
    assert examples[0].id == "gsm8k_test:0"


@needs_data
def test_qa_lists_and_math_strings():
    hotpot = load_examples(DATA / "hotpotqa_test.jsonl")
    assert hotpot[0].answers == ["Frank Lowy"]
    math = load_examples(DATA / "math500_test.jsonl")
    assert math[0].answers == ["\\left( 3, \\frac{\\pi}{2} \\right)"]


@needs_data
def test_arpo_parquet_schema():
    examples = load_examples(DATA / "arpo_rl_valid.parquet")
    kinds = [e.kind for e in examples]
    assert kinds.count("math") == 100 and kinds.count("qa") == 80
    first = examples[0]
    assert first.question == "Who is older, William Henry Rodes Green or Eleanor Of Lancaster?"
    assert first.answers == ["Eleanor Of Lancaster"]
    assert first.source == "DR_grpo_mix" and first.meta["split"] == "valid"
    # The published prompt carries a backspace where "\b" of "\boxed" was; it is repaired.
    assert "\x08" not in first.system_prompt and "\\boxed{answer here}" in first.system_prompt
    assert first.meta["repaired_system_prompt"] is True


@needs_data
def test_arpo_train_has_one_blank_answer():
    import pyarrow.parquet as pq

    path = DATA / "arpo_rl_train_10k.parquet"
    assert pq.ParquetFile(path).metadata.num_rows == 10_000
    with pytest.raises(DataError, match=r"arpo_rl_train_10k\.parquet: row 5275: no answer"):
        load_examples(path)
    examples = load_examples(path, on_bad_row="skip")
    assert len(examples) == 9_999
    kinds = [e.kind for e in examples]
    assert kinds.count("math") == 4_999 and kinds.count("qa") == 5_000
    assert load_examples(path, limit=7)[-1].id == "arpo_rl_train_10k:6"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shapes_of_answers(tmp_path):
    path = _jsonl(tmp_path / "mixed_math.jsonl", [
        {"problem": "p1", "answer": 42},
        {"question": "q2", "answer": 2.5},
        {"question": "q3", "answer": "Janet sells 1,000 eggs.\n#### 1,234"},
        {"question": "q4", "answer": ["a", "", "b"]},
        {"question": "q5", "answers": "x"},
        {"question": "q6", "answer": 7.0, "id": "custom"},
    ])
    ex = load_examples(path)
    assert [e.answers for e in ex] == [["42"], ["2.5"], ["1234"], ["a", "b"], ["x"], ["7"]]
    assert [e.question for e in ex[:2]] == ["p1", "q2"]
    assert {e.kind for e in ex} == {"math"}  # from the file name
    assert ex[5].id == "mixed_math:custom" and ex[0].source == "mixed_math"


def test_kind_override_limit_and_inference_failure(tmp_path):
    path = _jsonl(tmp_path / "things.jsonl",
                  [{"question": f"q{i}", "answer": "a"} for i in range(5)])
    with pytest.raises(DataError, match=r"things\.jsonl: row 1: cannot tell math from qa"):
        load_examples(path)
    ex = load_examples(path, kind="qa", limit=3)
    assert len(ex) == 3 and {e.kind for e in ex} == {"qa"}
    with pytest.raises(ValueError, match="kind must be one of"):
        load_examples(path, kind="code")


@pytest.mark.parametrize(("rows", "message"), [
    ([{"question": "q", "answer": "1"}, {"answer": "2"}], r"row 2: no question"),
    ([{"question": "q", "answer": "1"}, {"question": "q"}], r"row 2: no answer"),
    ([{"question": "q", "answer": []}], r"row 1: no answer"),
    ([{"question": "  ", "answer": "1"}], r"row 1: no question"),
    ([{"question": "q", "answer": "1"}, {"question": "q", "answer": "1"}, "{not json"],
     r"row 3: not valid JSON"),
    (["[1, 2]"], r"row 1: expected a JSON object"),
    ([{"question": "q", "answer": True}], r"row 1: answer must be"),
    ([{"question": "q", "answer": "work #### "}], r"row 1: '####' is not followed"),
    ([{"question": "q", "answer": "1", "ability": "code"}], r"row 1: ability 'code'"),
])
def test_bad_rows_name_file_and_row(tmp_path, rows, message):
    path = _jsonl(tmp_path / "gsm8k_bad.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(str(path)) + ": " + message):
        load_examples(path)


def test_skip_bad_rows(tmp_path):
    path = _jsonl(tmp_path / "gsm8k_some_bad.jsonl",
                  [{"question": "q", "answer": "1"}, {"question": "q"},
                   {"question": "r", "answer": 3}])
    ex = load_examples(path, on_bad_row="skip")
    assert [e.answers for e in ex] == [["1"], ["3"]]
    assert [e.id for e in ex] == ["gsm8k_some_bad:0", "gsm8k_some_bad:2"]


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_examples(tmp_path / "missing.jsonl")
    csv = tmp_path / "gsm8k.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_examples(csv)
    broken = tmp_path / "gsm8k.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_examples(broken)


def test_parquet_chat_schema_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(q, gt, ability="qa"):
        return {"data_source": "mix", "ability": ability,
                "prompt": [{"role": "system", "content": "sys \x08oxed{}"},
                           {"role": "user", "content": q}],
                "reward_model": {"ground_truth": gt, "style": "rule"},
                "extra_info": {"index": 9, "question": q, "split": "train"}}

    path = tmp_path / "rl.parquet"
    pq.write_table(pa.Table.from_pylist([row("Who?", "Ada"), row("2+2?", "4", "math"),
                                          row("Blank?", " ")]), path)
    with pytest.raises(DataError, match=r"rl\.parquet: row 3: no answer"):
        load_examples(path)
    ex = load_examples(path, limit=2)
    assert [(e.question, e.answers, e.kind) for e in ex] == [("Who?", ["Ada"], "qa"),
                                                             ("2+2?", ["4"], "math")]
    assert ex[0].system_prompt == "sys \\boxed{}" and ex[0].source == "mix"

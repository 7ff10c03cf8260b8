"""Data sources: the synthetic generator, local JSONL/Parquet files (GSM8K), prompt templates."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import SHARED_DATA
from rlpipe import artifacts
from rlpipe.config import params_from_dict
from rlpipe.data.splits import gsm8k_answer, write_splits as prepare

GSM8K = SHARED_DATA / "gsm8k"


def file_params(train, test, **data):
    return params_from_dict({"data": {"source": "file", "train_file": str(train), "test_file": str(test), **data}})


def test_synthetic_splits_are_disjoint_and_seeded(tmp_path):
    params = params_from_dict({"data": {"num_train": 300, "num_test": 50}})
    prepare(params.data, 0, tmp_path / "a/train.parquet", tmp_path / "a/test.parquet")
    prepare(params.data, 0, tmp_path / "b/train.parquet", tmp_path / "b/test.parquet")
    train = pq.read_table(tmp_path / "a/train.parquet").to_pydict()
    test = pq.read_table(tmp_path / "a/test.parquet").to_pydict()
    assert not set(train["prompt"]) & set(test["prompt"])
    assert (tmp_path / "a/train.parquet").read_bytes() == (tmp_path / "b/train.parquet").read_bytes()
    for prompt, answer in zip(train["prompt"], train["answer"]):
        a, b = prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(answer)


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert gsm8k_answer("#### 1,234") == "1234"
    with pytest.raises(ValueError):
        gsm8k_answer("no final line")


def test_gsm8k_from_local_files(tmp_path):
    if not GSM8K.is_dir():
        pytest.skip(f"{GSM8K} not found: the GSM8K copy of ../shared/data is absent")
    params = file_params(GSM8K / "train.jsonl", GSM8K / "test.jsonl", answer_format="gsm8k",
                         prompt_template="{question}\nAnswer with \\boxed{}.")
    counts = prepare(params.data, 0, tmp_path / "train.parquet", tmp_path / "test.parquet")
    assert counts == {"train_prompts": 7473, "test_prompts": 1319}
    for split in ("train", "test"):
        table = artifacts.read_table(tmp_path / f"{split}.parquet", artifacts.PROMPTS).to_pydict()
        assert all(float(a) == float(a) for a in table["answer"])  # every answer is numeric
        assert table["prompt"][0].endswith("Answer with \\boxed{}.")
        assert "####" in table["meta"][0]  # the full reference solution is kept


def test_parquet_source_and_field_mapping(tmp_path):
    rows = {"problem": ["1+1?", "2+2?"], "solution": ["2", "4"]}
    for name in ("train", "test"):
        pq.write_table(pa.table(rows), tmp_path / f"{name}.parquet")
    params = file_params(tmp_path / "train.parquet", tmp_path / "test.parquet", question_field="problem",
                         answer_field="solution", max_train=1)
    assert prepare(params.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet") == \
        {"train_prompts": 1, "test_prompts": 2}


def test_bad_files_name_the_file_and_row(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{oops\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"q": "x"}) + "\n")
    params = file_params(tmp_path / "train.jsonl", tmp_path / "test.jsonl", answer_format="gsm8k")
    with pytest.raises(artifacts.ArtifactError, match=r"train\.jsonl: line 2 is not JSON"):
        prepare(params.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet")
    # lines count from 1, blank lines included, as an editor shows them: the bad record is on line 4
    good = json.dumps({"question": "q", "answer": "#### 1"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n\n{good}\n" + json.dumps({"question": "q", "answer": "no hashes"}) + "\n")
    with pytest.raises(artifacts.ArtifactError, match=r"train\.jsonl: line 4, field 'answer': no '####' line"):
        prepare(params.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet")
    (tmp_path / "train.jsonl").write_text(good + "\n")
    with pytest.raises(artifacts.ArtifactError, match=r"test\.jsonl: line 1 has no field 'question'"):
        prepare(params.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet")
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["#### 1", "none"]}), tmp_path / "train.parquet")
    from_parquet = file_params(tmp_path / "train.parquet", tmp_path / "test.jsonl", answer_format="gsm8k")
    with pytest.raises(artifacts.ArtifactError, match=r"train\.parquet: row 2, field 'answer'"):
        prepare(from_parquet.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet")
    missing = file_params(tmp_path / "nope.jsonl", tmp_path / "test.jsonl")
    with pytest.raises(artifacts.ArtifactError, match="nope.jsonl: data file not found"):
        prepare(missing.data, 0, tmp_path / "o/train.parquet", tmp_path / "o/test.parquet")
    assert not (tmp_path / "o").exists()


def test_chat_template_and_system_prompt(tokenizer):
    import copy

    from rlpipe.data.prompts import encode_prompts

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    data = params_from_dict({"data": {"chat_template": True, "system_prompt": "1"}}).data
    ids = encode_prompts(chat, ["2+3"], data)
    assert chat.decode(ids[0]) == "1=2+3="
    plain = encode_prompts(tokenizer, ["2+3="])
    assert tokenizer.decode(plain[0], skip_special_tokens=True) == "2+3="
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tokenizer, ["2+3"], data)


def test_rounds_go_through_the_split_before_a_prompt_repeats():
    from rlpipe.data.splits import round_prompt_rows

    split, count = 1000, 300
    rounds = [round_prompt_rows(split, count, 0, f"r{k}") for k in range(1, 8)]
    stream = [row for rows in rounds for row in rows]
    assert all(len(rows) == count for rows in rounds)
    assert sorted(stream[:split]) == list(range(split))  # epoch 1: every prompt once
    assert sorted(stream[split : 2 * split]) == list(range(split))  # epoch 2 (r4 spans both)
    assert stream[:split] != stream[split : 2 * split]  # each epoch its own permutation
    assert round_prompt_rows(split, count, 0, "r3") == rounds[2]  # a round alone gives the same rows
    assert round_prompt_rows(split, count, 1, "r1") != rounds[0]  # seeded
    # more prompts than the split: whole epochs back to back
    big = round_prompt_rows(10, 25, 0, "r1")
    assert [sorted(big[i : i + 10]) for i in (0, 10)] == [list(range(10))] * 2
    # another stream for other consumers, independent of the rounds'
    assert round_prompt_rows(split, count, 0, "value_pretrain") != rounds[0]

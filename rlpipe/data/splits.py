"""Prompt data: building the train/test splits (the `prepare` stage) and choosing each round's prompts.

Torch-free. Each split is a `PROMPTS` table: prompt_id, prompt (text given to the policy), answer
(the reference the verifier checks), meta (task detail, e.g. the expected steps of `chain`), difficulty
(the bucket results are grouped by, e.g. "n4-carry" for `reasoning`; empty when the task has none).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa

from rlpipe import artifacts, paths
from rlpipe.config import DataConfig
from rlpipe.data.tasks import Example, generate_split


def synthetic_splits(cfg: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, test): seeded, disjoint prompts of the configured synthetic task."""
    terms = (cfg.min_terms, cfg.max_terms)
    test = generate_split(cfg.task, seed * 2 + 1, cfg.num_test, cfg.digits, cfg.chain_terms, terms=terms)
    train = generate_split(cfg.task, seed * 2, cfg.num_train, cfg.digits, cfg.chain_terms,
                           exclude=frozenset(e.prompt for e in test), terms=terms)
    return train, test


def _columns(examples: list[Example]) -> dict[str, list]:
    return {
        "prompt_id": list(range(len(examples))),
        "prompt": [e.prompt for e in examples],
        "answer": [e.answer for e in examples],
        "meta": [e.meta for e in examples],
        "difficulty": [e.difficulty for e in examples],
    }


def resolve_path(path: str) -> Path:
    """Relative data paths are taken from the repo root (DVC_ROOT inside `dvc exp run --temp`)."""
    candidate = Path(path)
    if candidate.is_absolute():
        return candidate
    return Path(os.environ.get("DVC_ROOT") or ".") / candidate


def read_records(path: Path) -> list[tuple[str, dict]]:
    """Rows of a .jsonl or .parquet file as (where, dict): `line N` of a .jsonl (blank lines counted, as
    an editor counts them), `row N` of a .parquet, both from 1, so that every error names what a user
    finds in the file."""
    if not path.is_file():
        raise artifacts.ArtifactError(f"{path}: data file not found")
    if path.suffix == ".parquet":
        return [(f"row {number}", row) for number, row in enumerate(artifacts.read_parquet_rows(path), start=1)]
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise artifacts.ArtifactError(f"{path}: line {number} is not JSON ({err})") from None
    return records


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K reference solution: the text after its last `####`."""
    if "####" not in solution:
        raise ValueError("no '####' line")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def records_to_examples(records: list[tuple[str, dict]], cfg: DataConfig, source: str) -> list[Example]:
    """Examples from (where, record) pairs; `where` (`line 5`, `row 3`, from 1) goes into every error."""
    examples = []
    for where, record in records:
        for field in (cfg.question_field, cfg.answer_field):
            if field not in record:
                raise artifacts.ArtifactError(f"{source}: {where} has no field {field!r} "
                                              f"(data.question_field / data.answer_field; it has {sorted(record)})")
        reference = str(record[cfg.answer_field])
        try:
            answer = gsm8k_answer(reference) if cfg.answer_format == "gsm8k" else reference.strip()
        except ValueError as err:
            raise artifacts.ArtifactError(f"{source}: {where}, field {cfg.answer_field!r}: {err}") from None
        prompt = cfg.prompt_template.replace("{question}", str(record[cfg.question_field]))
        examples.append(Example(prompt=prompt, answer=answer, meta=reference))
    return examples


def external_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, test) from local files or a hub dataset, first `max_train` / `max_test` rows."""
    if cfg.source == "file":
        sources = [resolve_path(cfg.train_file), resolve_path(cfg.test_file)]
        splits = [read_records(path) for path in sources]
    else:
        from datasets import load_dataset  # the `hub` extra; needs network access to the hub

        splits = [[(f"row {number}", row) for number, row in
                   enumerate(load_dataset(cfg.hf_dataset, cfg.hf_config, split=name), start=1)]
                  for name in (cfg.train_split, cfg.test_split)]
        sources = [f"{cfg.hf_dataset}[{name}]" for name in (cfg.train_split, cfg.test_split)]
    limits = (cfg.max_train, cfg.max_test)
    return tuple(records_to_examples(records[:limit], cfg, str(source))
                 for records, limit, source in zip(splits, limits, sources))  # type: ignore[return-value]


def write_splits(cfg: DataConfig, seed: int, train_path: Path = paths.TRAIN, test_path: Path = paths.TEST) -> dict:
    """Build the train and test splits from `data` and write them; returns their sizes."""
    train, test = synthetic_splits(cfg, seed) if cfg.source == "synthetic" else external_splits(cfg)
    for split, name in ((train, "train"), (test, "test")):
        if not split:
            raise artifacts.ArtifactError(f"data: the {name} split is empty")
    artifacts.write_table(train_path, _columns(train), artifacts.PROMPTS)
    artifacts.write_table(test_path, _columns(test), artifacts.PROMPTS)
    return {"train_prompts": len(train), "test_prompts": len(test)}


def read_prompts(path: Path) -> pa.Table:
    table = artifacts.read_table(path, artifacts.PROMPTS)
    if table.num_rows == 0:
        raise artifacts.ArtifactError(f"{path}: no prompts (0 rows)")
    return table


def round_prompt_rows(num_prompts: int, count: int, seed: int, round_name: str) -> list[int]:
    """Row indices of the `count` prompts of a round. The rounds r1, r2, ... read one stream of seeded
    permutations of the split (one per epoch) back to back: rK takes positions (K-1)*count to
    K*count - 1, so the rounds go through the whole split before any prompt repeats. Any other name
    (value_pretrain) reads the start of a stream of its own."""
    is_round = round_name[:1] == "r" and round_name[1:].isdigit()
    stream, start = ("rounds", (paths.round_index(round_name) - 1) * count) if is_round else (round_name, 0)
    rows: list[int] = []
    epoch, offset = divmod(start, num_prompts)
    while len(rows) < count:
        perm = list(range(num_prompts))
        random.Random(f"{seed}:prompts:{stream}:{epoch}").shuffle(perm)
        rows += perm[offset : offset + count - len(rows)]
        epoch, offset = epoch + 1, 0
    return rows

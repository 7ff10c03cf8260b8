"""The artifact contract: atomic writes, and reads that fail naming the file, the column and the row."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe import artifacts
from rlpipe.artifacts import ArtifactError
from rlpipe.atomic import atomic_directory


def rollout_columns(n_groups=2, m=2, greedy=False):
    rows = n_groups * (m + int(greedy))
    return {
        "prompt_id": [g for g in range(n_groups) for _ in range(m + int(greedy))],
        "group": [g for g in range(n_groups) for _ in range(m + int(greedy))],
        "sample": [k for _ in range(n_groups) for k in range(m + int(greedy))],
        "is_greedy": [greedy and k == m for _ in range(n_groups) for k in range(m + int(greedy))],
        "prompt": ["1+1="] * rows, "answer": ["2"] * rows, "meta": [""] * rows,
        "prompt_ids": [[1, 5, 14, 5, 15]] * rows,
        "response_ids": [[6, 2]] * rows,
        "response_text": ["2"] * rows,
        "behaviour_logprobs": [[-0.1, -0.2]] * rows,
        "finish_reason": ["stop"] * rows,
    }


def test_round_trip(tmp_path: Path):
    path = tmp_path / "rollouts.parquet"
    artifacts.write_table(path, rollout_columns(), artifacts.ROLLOUTS)
    table = artifacts.read_table(path, artifacts.ROLLOUTS)
    assert table.num_rows == 4
    assert table.column("behaviour_logprobs").to_pylist()[0] == pytest.approx([-0.1, -0.2])
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.parquet"]  # no temporary left behind


def test_missing_column_is_named(tmp_path: Path):
    path = tmp_path / "r.parquet"
    table = pa.table({k: v for k, v in rollout_columns().items() if k != "finish_reason"})
    pq.write_table(table, path)
    with pytest.raises(ArtifactError, match=r"r\.parquet: column 'finish_reason' is missing"):
        artifacts.read_table(path, artifacts.ROLLOUTS)


def test_wrong_dtype_is_named(tmp_path: Path):
    path = tmp_path / "r.parquet"
    columns = rollout_columns()
    table = artifacts.write_table(path, columns, artifacts.ROLLOUTS)
    bad = table.set_column(table.column_names.index("group"), "group", pa.array([str(g) for g in columns["group"]]))
    pq.write_table(bad, path)
    with pytest.raises(ArtifactError, match="column 'group' has type string, expected int64"):
        artifacts.read_table(path, artifacts.ROLLOUTS)


def test_truncated_file(tmp_path: Path):
    path = tmp_path / "r.parquet"
    artifacts.write_table(path, rollout_columns(), artifacts.ROLLOUTS)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="not a readable Parquet file"):
        artifacts.read_table(path, artifacts.ROLLOUTS)


def test_ragged_logprobs_name_the_row(tmp_path: Path):
    columns = rollout_columns()
    columns["behaviour_logprobs"] = [[-0.1, -0.2], [-0.1, -0.2], [-0.3], [-0.1, -0.2]]
    with pytest.raises(ArtifactError, match="column 'response_ids' row 2 has 2 entries but 'behaviour_logprobs' has 1"):
        artifacts.write_table(tmp_path / "r.parquet", columns, artifacts.ROLLOUTS)
    assert not any(tmp_path.iterdir())


def test_non_finite_values_name_the_row(tmp_path: Path):
    columns = rollout_columns()
    columns["behaviour_logprobs"] = [[-0.1, -0.2], [-0.1, math.nan], [-0.1, -0.2], [-0.1, -0.2]]
    with pytest.raises(ArtifactError, match="column 'behaviour_logprobs' row 1 is not finite"):
        artifacts.write_table(tmp_path / "r.parquet", columns, artifacts.ROLLOUTS)


def test_group_sizes(tmp_path: Path):
    path = tmp_path / "r.parquet"
    table = artifacts.write_table(path, rollout_columns(n_groups=2, m=2, greedy=True), artifacts.ROLLOUTS)
    artifacts.check_group_sizes(table, path, samples_per_prompt=2, greedy_per_group=1)
    with pytest.raises(ArtifactError, match="group 0 has 2 sampled responses, expected 3"):
        artifacts.check_group_sizes(table, path, samples_per_prompt=3, greedy_per_group=1)
    with pytest.raises(ArtifactError, match="group 0 has 1 greedy responses, expected 0"):
        artifacts.check_group_sizes(table, path, samples_per_prompt=2, greedy_per_group=0)


def test_atomic_directory_leaves_nothing_on_failure(tmp_path: Path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("killed")
    assert not target.exists() and not any(tmp_path.iterdir())
    with atomic_directory(target) as tmp:
        (tmp / "weights").write_text("whole")
    assert (target / "weights").read_text() == "whole" and len(list(tmp_path.iterdir())) == 1

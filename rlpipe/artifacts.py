"""The artifact contract: every Parquet file the stages exchange, its schema, atomic writes, checked reads.

Writers go through `rlpipe.atomic` (a temporary sibling, fsync, rename), so a killed stage never leaves a
half-written output that DVC or the next stage would accept. Readers check columns, dtypes and per-row consistency
(logprobs as long as the response, groups of the configured size) and fail naming the file, the column
and the row. Torch-free (pyarrow only): the reward stage uses it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlpipe.atomic import atomic_write_bytes
from rlpipe.errors import PipelineError

INT_LIST = pa.list_(pa.int32())
FLOAT_LIST = pa.list_(pa.float32())


class ArtifactError(PipelineError, ValueError):
    """An artifact that is missing, unreadable or breaks its schema; the message names file, column, row."""


@dataclass(frozen=True)
class Schema:
    name: str
    columns: dict[str, pa.DataType]
    same_length: tuple[tuple[str, str], ...] = ()
    """Pairs of list columns that must have equal length in every row (an empty second list is allowed
    for optional per-token columns, e.g. ref_logprobs when no reference is used)."""
    optional_empty: tuple[str, ...] = ()
    parent: "Schema | None" = None

    def all_columns(self) -> dict[str, pa.DataType]:
        return {**(self.parent.all_columns() if self.parent else {}), **self.columns}

    def all_pairs(self) -> tuple[tuple[str, str], ...]:
        return (self.parent.all_pairs() if self.parent else ()) + self.same_length

    def all_optional(self) -> tuple[str, ...]:
        return (self.parent.all_optional() if self.parent else ()) + self.optional_empty


PROMPTS = Schema("prompts", {"prompt_id": pa.int64(), "prompt": pa.string(), "answer": pa.string(), "meta": pa.string(),
                             "difficulty": pa.string()})

ROLLOUTS = Schema(
    "rollouts",
    {
        "prompt_id": pa.int64(),
        "group": pa.int64(),
        "sample": pa.int32(),
        "is_greedy": pa.bool_(),
        "prompt": pa.string(),
        "answer": pa.string(),
        "meta": pa.string(),
        "prompt_ids": INT_LIST,
        "response_ids": INT_LIST,
        "response_text": pa.string(),
        "behaviour_logprobs": FLOAT_LIST,
        "finish_reason": pa.string(),
    },
    same_length=(("response_ids", "behaviour_logprobs"),),
)

REWARDS = Schema(
    "rewards",
    {
        "reward": pa.float32(),
        "correct": pa.bool_(),
        "overlong_penalty": pa.float32(),
        "step_ends": INT_LIST,
        "step_rewards": FLOAT_LIST,
    },
    same_length=(("step_ends", "step_rewards"),),
    parent=ROLLOUTS,
)

BATCH = Schema(
    "batch",
    {
        "kept": pa.bool_(),
        "shaped_reward": pa.float32(),
        "old_logprobs": FLOAT_LIST,
        "ref_logprobs": FLOAT_LIST,
        "values": FLOAT_LIST,
        "advantages": FLOAT_LIST,
        "returns": FLOAT_LIST,
    },
    same_length=tuple((c, "response_ids") for c in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")),
    optional_empty=("ref_logprobs", "values", "returns"),
    parent=REWARDS,
)


# ---------------------------------------------------------------------------------------------------
def write_table(path: Path, columns: dict[str, list | pa.Array], schema: Schema) -> pa.Table:
    """Build a table with exactly the schema's columns and types (extra columns are an error)."""
    expected = schema.all_columns()
    unknown = set(columns) - set(expected)
    missing = set(expected) - set(columns)
    if unknown or missing:
        raise ArtifactError(f"{path}: writing {schema.name}: missing columns {sorted(missing)}, unknown {sorted(unknown)}")
    table = pa.table({name: pa.array(columns[name], type=dtype) for name, dtype in expected.items()})
    validate_table(table, schema, path)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    return table


# ---------------------------------------------------------------------------------------------------
def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file's table. `ParquetFile` rather than `pq.read_table`, whose dataset layer imports
    pandas: 0.18 s of the first read in a process, and the tables here are single files."""
    with pq.ParquetFile(path) as file:
        return file.read(columns=columns)


def read_table(path: Path, schema: Schema) -> pa.Table:
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: {schema.name} artifact not found; did the stage that writes it run?")
    try:
        table = read_parquet(path)
    except Exception as err:  # pyarrow raises several types for truncated or foreign files
        raise ArtifactError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None
    validate_table(table, schema, path)
    return table


def read_parquet_rows(path: Path) -> list[dict]:
    """A foreign Parquet file (e.g. a dataset) as a list of row dicts, with a clear error when unreadable."""
    try:
        return read_parquet(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for truncated or foreign files
        raise ArtifactError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None


def validate_table(table: pa.Table, schema: Schema, path: Path) -> None:
    missing = [name for name in schema.all_columns() if name not in table.column_names]
    if missing:
        raise ArtifactError(f"{path}: column {missing[0]!r} is missing (all missing: {missing}; "
                            f"a {schema.name} artifact has {list(schema.all_columns())})")
    for name, dtype in schema.all_columns().items():
        if not table.schema.field(name).type.equals(dtype):
            raise ArtifactError(f"{path}: column {name!r} has type {table.schema.field(name).type}, expected {dtype}")
        nulls = table.column(name).null_count
        if nulls:
            row = table.column(name).is_null().to_pylist().index(True)
            raise ArtifactError(f"{path}: column {name!r} has {nulls} null values (first at row {row})")
    optional = set(schema.all_optional())
    for a, b in schema.all_pairs():
        len_a = pc.list_value_length(table.column(a)).to_numpy(zero_copy_only=False)
        len_b = pc.list_value_length(table.column(b)).to_numpy(zero_copy_only=False)
        bad = (len_a != len_b) & ~((len_a == 0) & (a in optional))
        if bad.any():
            row = int(bad.argmax())
            raise ArtifactError(f"{path}: column {a!r} row {row} has {len_a[row]} entries but {b!r} has {len_b[row]}")
    _check_finite(table, schema, path)


def _check_finite(table: pa.Table, schema: Schema, path: Path) -> None:
    import numpy as np

    for name, dtype in schema.all_columns().items():
        column = table.column(name)
        if pa.types.is_list(dtype) and pa.types.is_floating(dtype.value_type):
            values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
            parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        elif pa.types.is_floating(dtype):
            values = column.to_numpy(zero_copy_only=False)
            parents = np.arange(len(values))
        else:
            continue
        bad = ~np.isfinite(values)
        if bad.any():
            raise ArtifactError(f"{path}: column {name!r} row {int(parents[bad.argmax()])} is not finite ({values[bad.argmax()]})")


def read_round_table(path: Path, schema: Schema, samples_per_prompt: int, greedy_per_group: int) -> pa.Table:
    """`read_table` of a round artifact (rollouts, rewards, batch), with its groups checked as configured."""
    table = read_table(path, schema)
    check_group_sizes(table, path, samples_per_prompt, greedy_per_group)
    return table


def check_group_sizes(table: pa.Table, path: Path, samples_per_prompt: int, greedy_per_group: int) -> None:
    """Every group holds `samples_per_prompt` sampled rows (+ `greedy_per_group` greedy ones)."""
    import numpy as np

    groups = table.column("group").to_numpy()
    greedy = table.column("is_greedy").to_numpy(zero_copy_only=False)
    if len(groups) == 0:
        raise ArtifactError(f"{path}: the batch is empty (0 rows)")
    sampled = np.bincount(groups[~greedy], minlength=groups.max() + 1)
    greedy_counts = np.bincount(groups[greedy], minlength=groups.max() + 1)
    for counts, want, what in ((sampled, samples_per_prompt, "sampled"), (greedy_counts, greedy_per_group, "greedy")):
        bad = np.flatnonzero(counts != want)
        if len(bad):
            row = int(np.flatnonzero(groups == bad[0])[0]) if (groups == bad[0]).any() else 0
            raise ArtifactError(
                f"{path}: column 'group' row {row}: group {int(bad[0])} has {int(counts[bad[0]])} {what} "
                f"responses, expected {want} (rollout.samples_per_prompt / the preset's greedy baseline)"
            )


@dataclass
class Columns:
    """A table's columns as Python lists, for the stages that add columns and write the next artifact."""

    data: dict[str, list] = field(default_factory=dict)

    @classmethod
    def of(cls, table: pa.Table) -> "Columns":
        return cls({name: table.column(name).to_pylist() for name in table.column_names})

    def __getitem__(self, name: str) -> list:
        return self.data[name]

    def __len__(self) -> int:
        return len(next(iter(self.data.values()))) if self.data else 0

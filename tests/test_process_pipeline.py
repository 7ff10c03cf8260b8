"""The PRM path through the real pipeline: `dvc exp run --temp -S algorithm.preset=grpo_process
-S data.task=chain` on the miniature params completes, and the step rewards reach the batch artifact
(restored the way a user would: `dvc exp apply` + `dvc checkout`)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from scratch import dvc, make_project, ran_stages

pytestmark = pytest.mark.slow


def test_grpo_process_on_the_chain_task(tmp_path):
    root = make_project(tmp_path / "project")
    log = dvc(root, "exp", "run", "--temp", "-n", "prm", "-S", "algorithm.preset=grpo_process", "-S", "data.task=chain")
    assert "evaluate" in ran_stages(log)
    dvc(root, "exp", "apply", "prm")
    dvc(root, "checkout")
    batch = pq.read_table(root / "runs/rounds/r1/batch.parquet").to_pydict()
    kept = [i for i, k in enumerate(batch["kept"]) if k]
    assert kept
    # the chain verifier scores each partial sum written: chain_terms - 1 = 2 are expected (extra steps
    # earn 0), each step end inside its response, step rewards in {0, 1}
    for i in kept:
        ends, rewards = batch["step_ends"][i], batch["step_rewards"][i]
        assert len(ends) == len(rewards) and not any(rewards[2:])
        assert all(0 <= e < len(batch["response_ids"][i]) for e in ends)
        assert set(rewards) <= {0.0, 1.0}
    assert any(len(batch["step_ends"][i]) == 2 for i in kept)
    assert any(sum(batch["step_rewards"][i]) > 0 for i in kept)
    # process advantages differ within a response (reward-to-go of the steps), unlike an outcome reward
    assert any(len(set(batch["advantages"][i])) > 1 for i in kept)

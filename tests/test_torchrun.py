"""torchrun with 2 gloo processes: after one micro-batched step on ragged lengths, the policy's and the
critic's gradients equal the single-process ones (loss counts all-reduced, groups dealt whole, DDP's
mean scaled back); so does FSDP2's policy gradient, which cannot take the shared-prompt forward and
stops with the key to change when the ranks' micro-batch counts differ. And the torchrun agents of a
multi-node update (the two-node run itself: tests/test_rounds.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "tests" / "torchrun_gradient.py"


def test_two_gloo_ranks_match_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
    single, double = tmp_path / "single.pt", tmp_path / "double.pt"
    subprocess.run([sys.executable, str(SCRIPT), str(single), str(tmp_path / "critic1")], check=True, env=env,
                   timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(SCRIPT), str(double), str(tmp_path / "critic2")], check=True, env=env, timeout=300)
    one, two = torch.load(single), torch.load(double)
    for mode in ("token-mean", "seq-mean-token-mean", "critic", "fsdp2"):
        assert one[mode].abs().sum() > 0
        difference = (one[mode] - two[mode]).abs().max().item()
        print(f"{mode}: max |gradient of 2 gloo ranks - of one process| {difference:.1e} "
              f"(largest entry {one[mode].abs().max().item():.1e})")
        assert difference < 1e-5, mode
    assert one["fsdp2_uneven"] == "single process"
    assert "update.micro_batch_tokens = 24 splits the ranks' shares into" in two["fsdp2_uneven"]


def test_the_agents_of_a_multi_node_update():
    """One node: torchrun's standalone rendezvous. Several: the static one, which numbers the nodes by
    --node_rank (so node 0, the stage's machine, holds rank 0), at node 0's endpoint, one id per round."""
    from rlpipe.config import params_from_dict
    from rlpipe.train.torchrun import torchrun_command

    one = torchrun_command(params_from_dict({"update": {"nproc": 2}}).update, "r3", "result.json")
    assert "--standalone" in one and "--nproc_per_node=2" in one
    update = params_from_dict({"update": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29500"}}).update
    node_1 = torchrun_command(update, "r3", "result.json", node_rank=1)
    assert "--standalone" not in node_1
    assert {"--nnodes=2", "--node_rank=1", "--rdzv_backend=static", "--rdzv_endpoint=10.0.0.1:29500",
            "--rdzv_id=rlpipe-update-r3", "--rdzv_conf=timeout=1800", "--nproc_per_node=1"} <= set(node_1)
    assert "--node_rank=0" in torchrun_command(update, "r3", "result.json")


TWO_NODES = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29500"}


@pytest.mark.parametrize("raw, round_name, node_rank, message", [
    ({}, "r1", 1, "update.nnodes is 1"),
    ({"update": TWO_NODES}, "r1", 0, r"--node-rank must be 1\.\.1 .*got 0"),
    ({"update": {**TWO_NODES, "nnodes": 3}}, "r1", 3, r"--node-rank must be 1\.\.2 .*got 3"),
    ({"rounds": 2, "update": TWO_NODES}, "r3", 1, "beyond `rounds: 2`"),
])
def test_update_node_refuses_a_node_that_cannot_join(raw, round_name, node_rank, message):
    """Before any agent starts (no torchrun here)."""
    from rlpipe.config import params_from_dict
    from rlpipe.errors import PipelineError
    from rlpipe.train.torchrun import run_node

    with pytest.raises(PipelineError, match=message):
        run_node(params_from_dict(raw), round_name, node_rank)

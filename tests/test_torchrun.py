"""torchrun with 2 gloo processes: after one micro-batched step on ragged lengths, the policy's and the
critic's gradients equal the single-process ones (loss counts all-reduced, groups dealt whole, DDP's
mean scaled back); so does FSDP2's policy gradient, which cannot take the shared-prompt forward and
stops with the key to change when the ranks' micro-batch counts differ."""

from __future__ import annotations

import os
import subprocess
import sys

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
        assert (one[mode] - two[mode]).abs().max() < 1e-5, mode
    assert one["fsdp2_uneven"] == "single process"
    assert "update.micro_batch_tokens = 24 splits the ranks' shares into" in two["fsdp2_uneven"]

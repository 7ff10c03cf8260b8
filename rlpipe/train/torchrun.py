"""The update under torchrun: `update.nproc` processes on each of `update.nnodes` nodes train the policy
(and the critic) together.

The stage process stays the one DVC and MLflow see: it launches
`torchrun --standalone --nproc_per_node N -m rlpipe.train.torchrun ROUND RESULT`, every rank runs
`update_policy` and then the critic update with its share of each minibatch's groups, rank 0 writes both
checkpoints and the metrics to RESULT, which the stage then logs.

With several nodes the stage's agent is node 0 and `rlpipe update-node` starts each other node's agent
(`run_node`), from the same params.yaml. They meet through torchrun's static rendezvous at
`update.rdzv_endpoint`, which numbers the nodes by their `--node_rank`: node 0's first process is global
rank 0, so the checkpoints and RESULT are written on the stage's machine. (The c10d rendezvous numbers
nodes by sorted host name and process id, which gives no such guarantee.)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rlpipe import paths
from rlpipe.errors import PipelineError


def torchrun_command(update, round_name: str, result: Path, node_rank: int = 0) -> list[str]:
    """The torchrun agent of node `node_rank` for the round's update (`update`: the params' section)."""
    if update.nnodes == 1:
        rendezvous = ["--standalone"]
    else:
        # one id per round: an agent started for another round waits for its own peers instead of joining
        rendezvous = [f"--nnodes={update.nnodes}", f"--node_rank={node_rank}", "--rdzv_backend=static",
                      f"--rdzv_endpoint={update.rdzv_endpoint}", f"--rdzv_id=rlpipe-update-{round_name}",
                      f"--rdzv_conf=timeout={update.rdzv_timeout}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={update.nproc}",
            "-m", "rlpipe.train.torchrun", round_name, str(result)]


def run_agent(params, round_name: str, result: Path, node_rank: int = 0) -> int:
    """Run this node's torchrun agent until its processes end; its exit status."""
    threads = max(1, params.runtime.torch_threads // params.update.nproc)
    command = torchrun_command(params.update, round_name, result, node_rank)
    return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)}).returncode


def describe(update) -> str:
    nodes = f" on each of {update.nnodes} nodes" if update.nnodes > 1 else ""
    return f"torchrun with {update.nproc} process{'es' * (update.nproc > 1)}{nodes}"


def launch(params, round_name: str) -> dict:
    """The round's update under torchrun, from the stage (node 0); the metrics rank 0 wrote."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-torchrun-") as tmp:
        result = Path(tmp) / "result.json"
        status = run_agent(params, round_name, result)
        if status != 0 or not result.is_file():
            raise PipelineError(f"update@{round_name}: {describe(params.update)} failed (exit {status}); see the "
                                f"ranks' messages above")
        return json.loads(result.read_text())


def run_node(params, round_name: str, node_rank: int) -> None:
    """Node `node_rank` (>= 1) of the round's update: its agent joins node 0's (`rlpipe update-node`)."""
    update = params.update
    if update.nnodes == 1:
        raise PipelineError("update.nnodes is 1 in params.yaml: the update runs on the stage's machine alone")
    if not 1 <= node_rank < update.nnodes:
        raise PipelineError(f"--node-rank must be 1..{update.nnodes - 1} for update.nnodes = {update.nnodes} "
                            f"(node 0 is the machine that runs the stage); got {node_rank}")
    if round_name not in params.round_names:
        raise PipelineError(f"round {round_name!r} is beyond `rounds: {params.rounds}` in params.yaml")
    with tempfile.TemporaryDirectory(prefix="rlpipe-torchrun-") as tmp:  # rank 0, on node 0, writes RESULT
        status = run_agent(params, round_name, Path(tmp) / "result.json", node_rank)
    if status != 0:
        raise PipelineError(f"update@{round_name}: node {node_rank} of {describe(update)} failed (exit {status}); "
                            f"see the ranks' messages above")


def check_same_params(params, round_name: str, world) -> None:
    """Every rank must train with the same params: a node whose checkout holds another params.yaml would
    otherwise train other settings on its share of the groups, silently."""
    if not world.distributed:
        return
    import torch

    mine = hashlib.sha256(json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    everyone: list = [None] * world.size
    torch.distributed.all_gather_object(everyone, mine)
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differing:
        raise PipelineError(f"update@{round_name}: ranks {differing} read another params.yaml than rank 0: every "
                            f"node must run in the same checkout (a shared filesystem)")


def main() -> int:
    import torch

    from rlpipe.config import load_params
    from rlpipe.models.device import use_deterministic_algorithms
    from rlpipe.train.critic import update_critic
    from rlpipe.train.distributed import init_world
    from rlpipe.train.policy import update_policy

    round_name, result = sys.argv[1], Path(sys.argv[2])
    params = load_params()
    torch.manual_seed(params.seed)
    use_deterministic_algorithms(params.runtime.deterministic)
    world = init_world()
    check_same_params(params, round_name, world)
    prev = paths.previous_round(round_name)
    metrics = update_policy(params, round_name, paths.batch_path(round_name), paths.policy_dir(prev),
                            paths.policy_dir(round_name), world=world)
    metrics.update(update_critic(params, round_name, paths.batch_path(round_name), paths.critic_dir(prev),
                                 paths.critic_dir(round_name), world))
    if world.is_main:
        result.write_text(json.dumps(metrics))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

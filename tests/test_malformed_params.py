"""At least 30 malformed params files, each rejected before any model loads, naming the key.

Every case is validated in process (fast), and a sample also runs a real stage process to show that
it exits with the message before torch or transformers are imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from rlpipe.config import ParamsError, load_params

BASE = yaml.safe_load((REPO / "params.yaml").read_text())


def patched(path: str, value):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[last] = value
    return raw


CASES = [
    # (description, params dict or raw text, the key the message must name)
    ("unknown top-level section", {**BASE, "optimizer": {"lr": 1}}, "optimizer"),
    ("unknown key in a section", patched("rollout.temprature", 1.0), "rollout.temprature"),
    ("unknown nested key", patched("model.tiny.width", 64), "model.tiny.width"),
    ("unknown value key", patched("value.pretrain.steps", 3), "value.pretrain.steps"),
    ("wrong type: string for float", patched("update.lr", "fast"), "update.lr"),
    ("wrong type: list for int", patched("rollout.samples_per_prompt", [8]), "rollout.samples_per_prompt"),
    ("wrong type: float for int", patched("rollout.max_new_tokens", 6.5), "rollout.max_new_tokens"),
    ("wrong type: string for bool", patched("update.shuffle", "maybe"), "update.shuffle"),
    ("wrong type: section as scalar", patched("eval", 3), "eval"),
    ("negative lr", patched("update.lr", -1e-4), "update.lr"),
    ("zero lr", patched("value.lr", 0), "value.lr"),
    ("zero max_new_tokens", patched("rollout.max_new_tokens", 0), "rollout.max_new_tokens"),
    ("zero prompts per round", patched("rollout.prompts_per_round", 0), "rollout.prompts_per_round"),
    ("oversample below one", patched("rollout.oversample", 0.5), "rollout.oversample"),
    ("top_p above one", patched("rollout.top_p", 1.5), "rollout.top_p"),
    ("negative top_k", patched("rollout.top_k", -1), "rollout.top_k"),
    ("zero temperature", patched("rollout.temperature", 0.0), "rollout.temperature"),
    ("unknown backend", patched("rollout.backend", "sglang"), "rollout.backend"),
    ("unknown recompute mode", patched("rollout.recompute_old_logprobs", "sometimes"), "rollout.recompute_old_logprobs"),
    ("unknown preset", patched("algorithm.preset", "grpo2"), "algorithm.preset"),
    ("unknown estimator", patched("algorithm.estimator", "vtrace"), "algorithm.estimator"),
    ("unknown loss_agg", patched("algorithm.loss_agg", "sum"), "algorithm.loss_agg"),
    ("unknown KL estimator", patched("algorithm.kl_estimator", "k4"), "algorithm.kl_estimator"),
    ("unknown KL placement", patched("algorithm.kl_placement", "both"), "algorithm.kl_placement"),
    ("negative eps_high", patched("algorithm.eps_high", -0.1), "algorithm.eps_high"),
    ("negative kl_beta", patched("algorithm.kl_beta", -0.01), "algorithm.kl_beta"),
    ("lambda above one", patched("algorithm.lam", 1.5), "algorithm.lam"),
    ("gamma above one", patched("algorithm.gamma", 1.01), "algorithm.gamma"),
    ("dual clip at or below one", patched("algorithm.clip_ratio_c", 0.9), "algorithm.clip_ratio_c"),
    ("ddof 2", patched("algorithm.std_ddof", 2), "algorithm.std_ddof"),
    ("group estimator with one sample", patched("rollout.samples_per_prompt", 1), "rollout.samples_per_prompt"),
    ("rounds as the old mapping of names", patched("rounds", {"r1": {"prev": "r0"}, "r2": {"prev": "r1"}}), "rounds"),
    ("zero rounds", patched("rounds", 0), "rounds"),
    ("rounds not a number", patched("rounds", "six"), "rounds"),
    ("pass@k beyond the samples", patched("eval.k", [1, 16]), "eval.k"),
    ("hidden not divisible by heads", patched("model.tiny.hidden", 130), "model.tiny.hidden"),
    ("unknown synthetic task", patched("data.task", "division"), "data.task"),
    ("file source without files", patched("data.source", "file"), "data.train_file"),
    ("template without {question}", patched("data.prompt_template", "Solve it."), "data.prompt_template"),
    ("step verifier on the addition task", patched("reward.verifier", "chain_steps"), "reward.verifier"),
    ("unknown dtype", patched("model.dtype", "float8"), "model.dtype"),
    ("zero torch threads", patched("runtime.torch_threads", 0), "runtime.torch_threads"),
    ("explained variance above one", patched("value.pretrain.min_explained_variance", 1.5),
     "value.pretrain.min_explained_variance"),
    ("negative rounds", patched("rounds", -3), "rounds"),
]


def write(tmp_path: Path, raw) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("description, raw, key", CASES, ids=[c[0] for c in CASES])
def test_malformed_params_name_the_key(tmp_path, description, raw, key):
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, raw))
    message = str(err.value)
    assert f"  {key}: " in message, message
    assert str(tmp_path / "params.yaml") in message  # the file is named too


@pytest.mark.parametrize("text, needle", [
    ("rollout: [1, 2\n", "not valid YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_unparseable_files(tmp_path, text, needle):
    with pytest.raises(ParamsError, match=needle):
        load_params(write(tmp_path, text))


STAGE_SAMPLE = [CASES[1], CASES[4], CASES[19], CASES[30]]


@pytest.mark.parametrize("stage", ["rollout", "update"])
@pytest.mark.parametrize("description, raw, key", STAGE_SAMPLE, ids=[c[0] for c in STAGE_SAMPLE])
def test_a_stage_exits_before_loading_a_model(tmp_path, stage, description, raw, key):
    write(tmp_path, raw)
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['{stage}.py', 'r1']\n"
        "try:\n"
        f"    runpy.run_path({str(REPO / 'stages' / (stage + '.py'))!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('EXIT', exit.code)\n"
        "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"RLPIPE_TRACKING": "0", "PATH": "/usr/bin:/bin"})
    assert f"  {key}: " in out.stdout
    assert "IMPORTED False False" in out.stdout
    assert not (tmp_path / "runs").exists()

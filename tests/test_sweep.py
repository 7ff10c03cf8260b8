"""The preset sweep (rlpipe/sweep.py) end to end on the miniature params: runs through `dvc exp run
--temp` two at a time, each in a clone of its own (a slot) sharing the DVC cache; one record per run with
its eval.json and every stage's MLflow metrics, a resumed sweep that runs nothing twice, and a restart
with other params refused; and the command line's checks."""

import json
import subprocess

import pytest

from scratch import MINI_PARAMS

from rlpipe.sweep import main, parse_entry, run_name


def experiment_refs(project):
    return subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=project,
                          capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.slow
def test_a_sweep_records_every_run_resumes_and_refuses_other_params(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["--params", str(MINI_PARAMS), "--seeds", "0", "1", "--jobs", "2", "--out", str(out), "grpo"]
    assert main(args) == 0
    project = out / "project"
    refs = experiment_refs(project)
    # one warm-up per seed (data and warm start), then the runs; each fetched from the slot that ran it
    assert sorted(ref.rsplit("/", 1)[-1] for ref in refs) == ["grpo-s0", "grpo-s1", "warm-s0", "warm-s1"]
    slots = sorted((out / "slots").iterdir())
    assert [slot.name for slot in slots] == ["0", "1"]
    assert sorted(ref for slot in slots for ref in experiment_refs(slot) if ref != "refs/exps/stash") == sorted(refs)
    records = {seed: json.loads((out / "runs" / f"{run_name('grpo', seed)}.json").read_text()) for seed in (0, 1)}
    for seed, record in records.items():
        ref = next(r for r in refs if r.endswith(f"/grpo-s{seed}"))
        shown = subprocess.run(["git", "show", f"{ref}:runs/metrics/eval.json"], cwd=project, capture_output=True,
                               text=True, check=True).stdout
        assert record["eval"] == json.loads(shown)
        assert record["wall_seconds"] > 0 and record["code_commit"]
        rewards = [s for s in record["stages"] if s["stage"].startswith("reward@")]
        assert [s["round"] for s in rewards] == ["r1", "r2"]
        assert all("reward/accuracy" in s["metrics"] for s in rewards)
    # the warm start hit the run cache: the runs logged no init stage of their own
    assert not any(s["stage"] == "init" for r in records.values() for s in r["stages"])
    assert records[0]["eval"]["curve"] != records[1]["eval"]["curve"]  # the seed reached the runs
    report = (out / "report.md").read_text()
    assert "2 of 2 runs recorded" in report and "| grpo | 2 |" in report

    # resumed after a kill between a run's end and its record: the record comes back, nothing runs again
    (out / "runs" / "grpo-s1.json").unlink()
    capsys.readouterr()
    assert main(args) == 0
    assert "1 of 2 runs recorded; 1 to go" in capsys.readouterr().out
    assert experiment_refs(project) == refs
    again = json.loads((out / "runs" / "grpo-s1.json").read_text())
    assert again["eval"] == records[1]["eval"] and again["wall_seconds"] is None

    other = tmp_path / "other.yaml"
    other.write_text(MINI_PARAMS.read_text().replace("rounds: 2", "rounds: 3"))
    with pytest.raises(SystemExit, match="other params_text"):
        main(["--params", str(other), "--out", str(out), "grpo"])


def test_a_run_entry_is_a_preset_with_overrides_of_its_own():
    assert parse_entry("vapo+value.pretrain.max_steps=0+update.lr=0.001") == (
        "vapo", ["value.pretrain.max_steps=0", "update.lr=0.001"])
    assert parse_entry("dr_grpo") == ("dr_grpo", [])
    assert run_name("dr_grpo", 2) == "dr-grpo-s2"
    assert run_name("vapo+value.pretrain.max_steps=0", 0) == "vapo-value-pretrain-max-steps-0-s0"


@pytest.mark.parametrize("args, message", [
    (["grpoo"], "unknown preset(s) grpoo"),
    (["vapo+value.pretrain.max_steps"], "override(s) without a value: value.pretrain.max_steps"),
    (["--params", "nowhere.yaml", "grpo"], "--params: no file nowhere.yaml"),
    (["--report-only"], "holds no sweep"),
])
def test_the_command_line_names_what_is_wrong(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "sweep"), *args])
    assert message in capsys.readouterr().err


def test_more_threads_than_cores_is_warned_about_naming_both_knobs(tmp_path, monkeypatch):
    from rlpipe.sweep import oversubscription_warning

    params = tmp_path / "params.yaml"
    params.write_text("runtime:\n  torch_threads: 2\n")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert oversubscription_warning(params, (), jobs=1) is None
    warning = oversubscription_warning(params, (), jobs=2)
    assert "--jobs 2 x runtime.torch_threads 2 = 4 threads on 2 cores" in warning
    assert "--jobs 1" in warning and "-S runtime.torch_threads=1" in warning
    assert oversubscription_warning(params, ("runtime.torch_threads=1",), jobs=2) is None
    assert oversubscription_warning(params, ("+runtime.torch_threads=3",), jobs=1) is not None

"""Stage outputs hand DVC their md5 (rlpipe/dvc_state.py): the digests are those of the bytes on disk,
DVC takes them instead of reading the files again, and nothing is recorded outside a DVC stage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from rlpipe.atomic import atomic_directory
from rlpipe.scratch_project import scratch_env

from scratch import dvc


def test_atomic_directory_gives_each_files_md5_under_its_final_path(tmp_path: Path):
    md5s: dict[Path, str] = {}
    payload = os.urandom(20 << 20)  # more than one hashing chunk
    with atomic_directory(tmp_path / "ckpt", md5s) as tmp:
        (tmp / "weights.bin").write_bytes(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "config.json").write_text("{}")
    assert md5s == {tmp_path / "ckpt" / "weights.bin": hashlib.md5(payload).hexdigest(),
                    tmp_path / "ckpt" / "sub" / "config.json": hashlib.md5(b"{}").hexdigest()}


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rlpipe import dvc_state
    from rlpipe.atomic import atomic_directory

    mode, seed = sys.argv[1], sys.argv[2]
    if mode == "honest":
        with dvc_state.stage_output_directory(Path("ckpt")) as tmp:
            (tmp / "weights.bin").write_bytes(seed.encode() * 100_000)
    else:  # record a digest that is not the file's: what dvc.lock shows tells who hashed the file
        md5s = {}
        with atomic_directory(Path("ckpt"), md5s) as tmp:
            (tmp / "weights.bin").write_bytes(seed.encode() * 100_000)
        assert dvc_state.record_md5s({path: "0" * 32 for path in md5s})
""")


def make_project(root: Path, mode: str) -> None:
    root.mkdir()
    (root / "writer.py").write_text(WRITER)
    (root / "params.yaml").write_text("seed: a\n")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"write": {
        "cmd": f"{sys.executable} writer.py {mode} ${{seed}}", "params": ["seed"], "outs": ["ckpt"]}}}))
    for args in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        subprocess.run(args, cwd=root, check=True, env=scratch_env())
    with open(root / ".dvc" / "config", "a") as config:
        config.write("[cache]\n    type = hardlink,symlink,copy\n")


def recorded_file_md5(root: Path) -> str:
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    dir_md5 = lock["stages"]["write"]["outs"][0]["md5"]
    listing = json.loads((root / ".dvc" / "cache" / "files" / "md5" / dir_md5[:2] / dir_md5[2:]).read_text())
    return {entry["relpath"]: entry["md5"] for entry in listing}["weights.bin"]


def test_dvc_takes_the_md5_a_stage_recorded_instead_of_reading_the_file(tmp_path: Path):
    honest, planted = tmp_path / "honest", tmp_path / "planted"
    make_project(honest, "honest")
    make_project(planted, "planted")
    for root in (honest, planted):
        dvc(root, "repro")
    truth = hashlib.md5(b"a" * 100_000).hexdigest()
    assert recorded_file_md5(honest) == truth
    # DVC wrote the planted digest into its records: it did not read the file, it took the state entry
    assert recorded_file_md5(planted) == "0" * 32


def test_nothing_is_hashed_or_recorded_outside_a_dvc_stage(tmp_path: Path, monkeypatch):
    from rlpipe import dvc_state

    monkeypatch.delenv("DVC_STAGE", raising=False)
    monkeypatch.setattr(dvc_state, "record_md5s", lambda md5s: (_ for _ in ()).throw(AssertionError("recorded")))
    with dvc_state.stage_output_directory(tmp_path / "ckpt") as tmp:
        (tmp / "weights.bin").write_bytes(b"x")
    assert (tmp_path / "ckpt" / "weights.bin").read_bytes() == b"x"


def test_streamed_and_announced_files_get_the_md5_of_their_bytes_and_a_rewrite_is_hashed_again(tmp_path: Path):
    import torch

    from rlpipe.file_md5 import files_written, open_for_writing

    state = {"exp_avg": torch.randn(3, 1 << 18), "step": torch.tensor(7.0)}
    md5s: dict[Path, str] = {}
    with atomic_directory(tmp_path / "ckpt", md5s) as tmp:
        (tmp / "weights.bin").write_bytes(b"first")
        files_written(tmp)  # announced, then rewritten: the announced digest must not be used
        (tmp / "weights.bin").write_bytes(b"second, longer")
        with open_for_writing(tmp / "optimizer.pt") as handle:
            torch.save(state, handle)
        (tmp / "trainer_state.json").write_text("{}")  # never announced: hashed at the end
    final = tmp_path / "ckpt"
    assert md5s == {file: hashlib.md5(file.read_bytes()).hexdigest() for file in final.iterdir()}
    assert len(md5s) == 3
    loaded = torch.load(final / "optimizer.pt")
    assert torch.equal(loaded["exp_avg"], state["exp_avg"])


def test_outside_a_hashing_directory_the_writers_are_plain_writes(tmp_path: Path):
    from rlpipe.file_md5 import files_written, open_for_writing

    files_written(tmp_path)
    with open_for_writing(tmp_path / "x.bin") as handle:
        assert type(handle).__name__ == "BufferedWriter"
        handle.write(b"abc")
    assert (tmp_path / "x.bin").read_bytes() == b"abc"

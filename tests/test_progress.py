"""Progress off a terminal: a plain line a minute for long work, nothing for short work or when
`RLPIPE_PROGRESS=0`."""

from rlpipe.progress import ProgressLines, progress


def test_off_a_terminal_long_work_writes_lines_with_counts_and_the_last_values(capsys):
    with ProgressLines(total=4, desc="verifier phase", unit="step", interval=0.0) as lines:
        for step in range(4):
            lines.set_postfix(loss=f"{0.5 / (step + 1):.3f}", ev="0.100")
            lines.update(1)
    written = capsys.readouterr().err.splitlines()
    assert written[0].startswith("verifier phase: 1/4 step (25%), 0m00s, loss=0.500 ev=0.100")
    assert written[3].startswith("verifier phase: 4/4 step (100%), 0m00s, loss=0.125")
    assert written[-1] == "verifier phase: 4/4 step (100%), 0m00s (done), loss=0.125 ev=0.100"
    assert len(written) == 5


def test_work_shorter_than_the_interval_writes_nothing(capsys):
    with ProgressLines(total=None, desc="sample", unit="seq", interval=3600.0) as lines:
        lines.update(100)
    assert capsys.readouterr().err == ""


def test_the_environment_chooses_lines_or_silence(monkeypatch):
    monkeypatch.delenv("RLPIPE_PROGRESS", raising=False)  # pytest's stderr is not a terminal
    assert isinstance(progress(total=3, desc="x"), ProgressLines)
    monkeypatch.setenv("RLPIPE_PROGRESS", "0")
    with progress(total=3, desc="x") as bar:
        assert not isinstance(bar, ProgressLines) and bar.disable


def test_torchruns_other_ranks_write_no_lines(monkeypatch):
    monkeypatch.delenv("RLPIPE_PROGRESS", raising=False)
    monkeypatch.setenv("RANK", "1")
    assert not isinstance(progress(total=3, desc="x"), ProgressLines)


def test_a_loop_that_raises_is_not_called_done(capsys):
    try:
        with ProgressLines(total=4, desc="update r1", unit="step", interval=0.0) as lines:
            lines.update(1)
            raise RuntimeError("out of memory")
    except RuntimeError:
        pass
    assert capsys.readouterr().err == "update r1: 1/4 step (25%), 0m00s\n"

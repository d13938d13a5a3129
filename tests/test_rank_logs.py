"""Each rank's own log file carries that rank's pipedap messages, ``[rank r]``-prefixed, under one file name
in a single run and in a sweep (they used to stay empty: every message was rank-0-only)."""

from __future__ import annotations

import logging
import sys
import warnings
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_pipedap.strategy.messages as M
from lightning_pipedap.app.train import LogToJobDir


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(r: int) -> None:
        monkeypatch.setattr(rank_zero_only, "rank", r, raising=False)
    return set_rank


def test_another_rank_logs_its_warnings_errors_and_set_up_line_to_its_own_file(tmp_path, as_rank):
    cb = LogToJobDir(str(tmp_path), "train")
    trainer = SimpleNamespace(global_rank=1)
    as_rank(1)
    cb.setup(trainer, None, "fit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # rank 1 issues no Python warning (rank 0 does, once)
            M.every_rank("pipedap: rank 1 of 2 set up on h (pid 7)")
            M.info("pipedap: schedule dear: 1 buckets: RS0 AG0")  # the plan: rank 0 only
            M.warn("pipedap: something rank 1 saw")
        M.log.error("pipedap: rank %s failed", 1)
    finally:
        cb.teardown(trainer, None, "fit")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["train_ddp_process_1.log"]  # Lightning's name for a popen rank's Hydra log, not train_rank1.log
    lines = [line.split(" - ", 1)[1] for line in (tmp_path / files[0]).read_text().splitlines()]
    assert lines == ["[rank 1] pipedap: rank 1 of 2 set up on h (pid 7)", "[rank 1] pipedap: something rank 1 saw",
                     "[rank 1] pipedap: rank 1 failed"]


def test_rank_zero_messages_are_unchanged(tmp_path, as_rank, caplog):
    as_rank(0)
    cb = LogToJobDir(str(tmp_path), "train")
    cb.setup(SimpleNamespace(global_rank=0), None, "fit")
    try:
        with caplog.at_level(logging.INFO, logger="lightning_pipedap"), pytest.warns(UserWarning, match="careful"):
            M.info("pipedap: schedule dear")
            M.warn("pipedap: careful")
    finally:
        cb.teardown(SimpleNamespace(global_rank=0), None, "fit")
    assert [r.getMessage() for r in caplog.records if r.name == "lightning_pipedap"] == [
        "pipedap: schedule dear", "pipedap: careful"]
    assert [p.name for p in tmp_path.iterdir()] == ["train.log"]


class _Failing:
    """What CollectivesOffAfterFailure.abort needs of a strategy."""

    def __init__(self, rank):
        from lightning_pipedap.strategy.failure import CollectivesOffAfterFailure

        self.abort = CollectivesOffAfterFailure.abort.__get__(self)
        self._aborted, self.global_rank = False, rank

    def stop_fit_after_failure(self, word):
        pass


def test_a_failure_goes_to_the_rank_log_file_with_its_traceback_not_to_the_terminal(tmp_path, as_rank, capsys):
    """Each rank printed its error twice (pipedap's record with the traceback, then Python's or Hydra's report):
    the record now goes to the log files only, [rank r]-prefixed and with the traceback."""
    as_rank(1)
    console = logging.StreamHandler(sys.stderr)  # Hydra's console handler (it writes to stdout: the same)
    root = logging.getLogger()
    root.addHandler(console)
    cb = LogToJobDir(str(tmp_path), "train")
    cb.setup(SimpleNamespace(global_rank=1), None, "fit")
    try:
        try:
            raise ValueError("pipedap: Model has no trainable parameters")
        except ValueError as exc:
            _Failing(1).abort(exc)
    finally:
        cb.teardown(SimpleNamespace(global_rank=1), None, "fit")
        root.removeHandler(console)
    text = (tmp_path / "train_ddp_process_1.log").read_text()
    assert "[rank 1] pipedap: rank 1 failed; collectives of the default group are skipped from now on" in text
    assert "Traceback (most recent call last):" in text and "ValueError: pipedap: Model has no trainable" in text
    err = capsys.readouterr().err
    assert "Traceback" not in err and "failed" not in err, err


def test_without_a_log_file_a_failure_prints_nothing_of_its_own(as_rank, capsys, monkeypatch):
    """A plain script (no handler: Python's last-resort handler used to print the record and its traceback)."""
    as_rank(0)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (pytest's own capture handlers)
    monkeypatch.setattr(M.log, "handlers", [h for h in M.log.handlers if M.is_console(h)])
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        _Failing(0).abort(exc)
    assert capsys.readouterr().err == ""


def test_a_log_line_never_shares_a_line_with_a_tqdm_progress_bar(monkeypatch):
    """pipedap's lines landed inside the progress bar's line ('Epoch 0:  40%|####  | 4/10 [...]pipedap: schedule
    ...'): a console handler routed by the app writes around the bar (cleared, line written, bar redrawn)."""
    import io

    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)  # Hydra's console handler, on the bar's stream
    handler.setFormatter(logging.Formatter("%(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    monkeypatch.setattr(M, "is_console", lambda h: h is handler)  # (a StringIO stands for the terminal)
    assert M.route_console_handlers() == 1 and isinstance(handler.stream, M.BarAwareStream)
    assert M.route_console_handlers() == 1 and isinstance(handler.stream.wrapped_stream, io.StringIO)  # (once)
    bar = Tqdm(total=10, desc="Epoch 0", file=terminal, dynamic_ncols=False, ncols=60, mininterval=0)
    try:
        bar.update(4)
        logging.getLogger("lightning_pipedap").warning("pipedap: schedule dear: 2 buckets")
        bar.update(1)
    finally:
        bar.close()
    screen = terminal.getvalue().replace("\r", "\n").splitlines()
    assert "pipedap: schedule dear: 2 buckets" in screen, screen  # a line of its own
    assert not [line for line in screen if "pipedap" in line and "Epoch" in line]


def test_a_log_line_goes_through_the_rich_progress_bars_console_while_it_runs(monkeypatch):
    import io

    from rich.console import Console
    from rich.progress import Progress

    terminal, ours = io.StringIO(), io.StringIO()
    handler = M.around_bars(logging.StreamHandler(ours))
    handler.setFormatter(logging.Formatter("%(message)s"))
    progress = Progress(console=Console(file=terminal, force_terminal=True, width=80))
    progress.add_task("Epoch 0", total=10)
    progress.start()
    try:
        M.use_progress_bar(SimpleNamespace(progress=progress))  # what the strategy does with the fit's bar
        handler.emit(logging.makeLogRecord({"msg": "pipedap: schedule dear", "levelno": logging.INFO}))
    finally:
        progress.stop()
        M.use_progress_bar(None)
    assert "pipedap: schedule dear" in terminal.getvalue() and ours.getvalue() == ""
    handler.emit(logging.makeLogRecord({"msg": "after the bar", "levelno": logging.INFO}))
    assert ours.getvalue() == "after the bar\n"


def test_another_ranks_lines_go_to_its_log_file_not_into_rank_zeros_progress_bar(tmp_path, as_rank, capsys):
    """A popen rank's Hydra console handler printed its lines on the terminal rank 0's progress bar is drawn on, where
    no rank can clear another's bar: they go to the rank's own log file only (rank 0 says each warning once)."""
    as_rank(1)
    console = logging.StreamHandler(sys.stdout)  # Hydra's console handler of rank 1
    root = logging.getLogger()
    root.addHandler(console)
    cb = LogToJobDir(str(tmp_path), "train")
    cb.setup(SimpleNamespace(global_rank=1), None, "fit")
    try:
        M.every_rank("pipedap: rank 1 of 2 set up on h (pid 7)")
        M.warn("pipedap: something rank 1 saw")
    finally:
        cb.teardown(SimpleNamespace(global_rank=1), None, "fit")
        root.removeHandler(console)
    assert capsys.readouterr().out == ""
    text = (tmp_path / "train_ddp_process_1.log").read_text()
    assert "[rank 1] pipedap: rank 1 of 2 set up" in text and "[rank 1] pipedap: something rank 1 saw" in text

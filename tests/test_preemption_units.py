"""Units of the exit paths (no processes): pre-emption state, the SIGTERM handler by phase, the exit codes decided at
exit, lost-peer errors named, non-finite final parameters described."""

from __future__ import annotations

import pytest
import torch

import lightning_pipedap.engine.collectives as C
from lightning_pipedap.strategy import preemption
from lightning_pipedap.strategy.numerics import nonfinite_parameters


@pytest.fixture
def state(monkeypatch):
    """A fresh per-process state; no real handler installed, ``exit_now`` recorded instead of exiting."""
    monkeypatch.setattr(preemption, "_state", preemption._State())
    monkeypatch.setattr(preemption, "install", lambda: None)
    exits: list[int] = []
    monkeypatch.setattr(preemption, "exit_now", exits.append)
    return exits


def test_a_peer_word_marks_the_process_pre_empted_only_for_sigterm_or_stopped(state):
    preemption.start_fit(0)
    assert not preemption.note_peer_words({1: "failed", 2: "left"})
    assert not preemption.preempted() and preemption.exit_code(1) == 1
    assert preemption.note_peer_words({1: "failed", 2: "stopped"})
    assert preemption.preempted() and preemption.exit_code(1) == 143
    assert preemption._state.source == "rank 2"


def test_sigterm_during_set_up_raises_once_then_counts(state):
    preemption.start_fit(1)
    with pytest.raises(SystemExit) as info:
        preemption._on_sigterm(15, None)
    assert info.value.code == 143
    preemption._on_sigterm(15, None)  # (a second one while the first unwinds: no second exception)
    assert preemption.own_signals() == 2 and state == []


def test_sigterm_during_the_fit_only_marks_and_after_it_exits_143(state):
    preemption.start_fit(0)
    preemption.enter_fit()
    preemption._on_sigterm(15, None)
    assert preemption.preempted() and state == []
    preemption.end_fit()
    preemption._on_sigterm(15, None)
    assert state == [143]


def test_exit_codes_decided_at_exit(state, monkeypatch):
    preemption.start_fit(1)
    preemption._at_exit()
    assert state == []  # (a fit that ended well: the interpreter exits as usual)
    preemption.note_nonfinite_parameters("1 of 5 parameters hold NaN or inf")
    preemption._at_exit()
    assert state == [3]
    preemption.note_failed_fit()
    monkeypatch.setattr("sys.last_value", RuntimeError("x"), raising=False)
    preemption._at_exit()
    assert state == [3, 1]
    preemption.note("rank 0")
    preemption._at_exit()
    assert state == [3, 1, 143]


class _Heartbeat:
    def describe(self, wait_s: float = 0.0) -> str:
        return "rank 1: no heartbeat for the last 2.0 s (stopped or dead?)"


def test_a_backend_error_about_a_lost_peer_is_named(monkeypatch):
    monkeypatch.setattr(C, "_heartbeat", _Heartbeat())
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. "
                        "This is typically caused by a remote worker\nsecond line")
    named = C.named_peer_failure(gloo, "DDP's gradient all-reduce (backward)", step=40)
    assert isinstance(named, C.PeerLostError)
    assert str(named) == ("pipedap: rank ?: DDP's gradient all-reduce (backward) at step 40 failed (rank 1: no "
                          "heartbeat for the last 2.0 s (stopped or dead?)): [gloo/transport/tcp/pair.cc:537] Read "
                          "error [127.0.0.1]:1: Connection reset by peer. This is typically caused by a remote worker")
    assert C.named_peer_failure(RuntimeError("shape mismatch"), "x") is None
    assert C.named_peer_failure(RuntimeError("pipedap: rank 1: already named, Connection reset"), "x") is None
    assert C.named_peer_failure(ValueError("Connection reset"), "x") is None
    with pytest.raises(C.PeerLostError, match="Lightning's barrier 'ckpt' failed") as info:
        with C.naming_peer_failures("Lightning's barrier 'ckpt'"):
            raise gloo
    assert info.value.__cause__ is gloo


def test_nonfinite_parameters_names_the_first_and_counts():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert nonfinite_parameters(m) is None
    with torch.no_grad():
        m[1].weight[0, 0] = float("nan")
        m[1].weight[0, 1] = float("inf")
        m[1].bias.fill_(float("-inf"))
    assert nonfinite_parameters(m) == ("2 of 4 parameters hold NaN or inf (first: '1.weight', 1 NaN and 1 inf of "
                                       "2 values)")
    big = torch.nn.Linear(2, 1)
    with torch.no_grad():
        big.weight.fill_(3e38)  # (the sum overflows; every value is finite)
    assert nonfinite_parameters(big) is None


def test_sigterm_after_a_fit_that_ended_well_leaves_the_decision_to_the_handler_that_called_it(state):
    """Lightning keeps the handler it found as one of its own during a later fit with another strategy: ours, called
    from it after a pipedap fit that was not pre-empted, neither exits nor kills (this process's handler is
    not ours here)."""
    preemption.start_fit(0)
    preemption.enter_fit()
    preemption.end_fit()
    preemption._on_sigterm(15, None)
    assert state == [] and not preemption.preempted()

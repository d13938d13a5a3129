"""Measured plan selection: the :class:`Trial` in progress, its rules (racing, confirmation against DDP's reducer,
the choice at the start-up budget) and its results (:class:`Selection`), and the choice itself
(:func:`choose_candidate`, on :func:`lower_quartile` step times of interleaved windows).

The :class:`~lightning_pipedap.strategy.controller.Controller` switches phases and candidates; this module decides
which candidate is measured next and which one wins. No Lightning, torch or ``torch.distributed`` import.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from lightning_pipedap.strategy.startup import steps_text

#: most measured steps of one trial window (short steps are measured over ``trial_window_s``)
MAX_WINDOW_STEPS = 50
#: candidates kept unless another is faster by more than ``choose_candidate``'s ``prefer_margin``
PREFERRED = ("torch_ddp",)
#: racing: after each round of trial windows, a candidate whose median so far is slower than the leader's by more
#: than this fraction is measured no more (successive halving's idea, with a noise-sized margin)
RACE_DROP = 0.25
#: fewest measured steps of a trial window when the start-up budget shortens the windows
MIN_BUDGET_WINDOW = 2


@dataclass
class Trial:
    """Measured plan selection in progress.

    Attributes:
        schedules: candidate engine schedules (``name``, ``describe()``, ``predicted_iteration_s``).
        no_overlap_s: no-overlap time of each candidate (s).
        order: the candidate index of each measurement window, one round at a time (racing appends the next
            round of the candidates still in the race).
        window: the window being measured (index into ``order``).
        starts: clock at each step start of the current window (s).
        gaps_s: per candidate, every step interval of each of its windows, the settling one first (s).
        confirm: ``(winner, preferred, first_pass_windows)`` while the windows after ``order``'s first pass
            measure the first pass's winner against the preferred candidate it displaced (indices; the
            number of windows each had before), else None.
    """

    schedules: list[Any]
    no_overlap_s: list[float]
    order: list[int] = field(default_factory=list)
    window: int = 0
    starts: list[float] = field(default_factory=list)
    gaps_s: list[list[list[float]]] = field(default_factory=list)
    confirm: Optional[tuple[int, int, int]] = None
    #: candidates still raced (indices); rounds of windows finished
    alive: list[int] = field(default_factory=list)
    rounds_done: int = 0
    #: racing notes (which candidate was dropped after which round, with the numbers)
    dropped: list[str] = field(default_factory=list)


def lower_quartile(values: Sequence[float]) -> float:
    """The 25th percentile (nearest rank) of ``values``: a trial window's step time. On a shared machine
    load only adds time, in bursts that can cover half a window; the lower quartile follows the
    candidate's own speed where the median follows the bursts.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("lower_quartile of no values")
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def choose_candidate(names: Sequence[str], windows_s: Sequence[Sequence[float]], floor_s: Optional[float] = None,
                     *, min_tolerance: float = 0.02, max_tolerance: float = 0.10,
                     prefer: Sequence[str] = PREFERRED,
                     prefer_margin: float = 0.10) -> tuple[int, list[float], list[str]]:
    """Pick the fastest candidate from interleaved trial windows, robust to a noisy machine.

    Args:
        names: candidate names, in trial order (the planner's first).
        windows_s: per candidate, the step time of each of its measurement windows (s; the strategy gives
            each window's :func:`lower_quartile`).
        floor_s: physical lower bound of a dense step (s, see :meth:`Effects.comm_floor_s`); a candidate
            whose median is below ``0.9 * floor_s`` was mismeasured and is not chosen while another one
            was measured at or above it.
        min_tolerance, max_tolerance: the noise band, as a fraction of the fastest median: the spread
            between the windows of the two fastest candidates (max/min - 1), clamped to this range.
        prefer: names chosen first among candidates within the noise band of the fastest (then trial
            order): a tie is decided the same way on every rerun.
        prefer_margin: a preferred candidate (DDP's reducer: DDP's results and speed by construction) is
            also kept against any candidate not faster by more than this fraction, whatever the noise:
            a wrong switch away from it can cost more than the margin, as trial windows on a shared
            machine can mislead by more than their spread.
    Returns:
        ``(chosen index, median of each candidate's windows (s), notes)``: notes say which candidates
        were rejected below the floor and which were within noise of the fastest.

    Raises:
        ValueError: no candidate, or a candidate without a window.
    """
    if not names or len(names) != len(windows_s) or any(not w for w in windows_s):
        raise ValueError(f"every candidate needs at least one measured window, got {list(windows_s)!r} for {names!r}")
    medians = [statistics.median(w) for w in windows_s]
    notes: list[str] = []
    valid = list(range(len(names)))
    if floor_s is not None and floor_s > 0:
        low = [i for i in valid if medians[i] < 0.9 * floor_s]
        if low and len(low) < len(valid):
            valid = [i for i in valid if i not in low]
            notes.append("below the physical floor " + f"{floor_s * 1e3:.1f} ms, not chosen: "
                         + ", ".join(f"{names[i]} {medians[i] * 1e3:.1f} ms" for i in low))
    ranked = sorted(valid, key=medians.__getitem__)
    best = ranked[0]

    def spread(i: int) -> float:
        w = windows_s[i]
        return max(w) / min(w) - 1.0 if min(w) > 0 else 0.0

    noise = max(spread(i) for i in ranked[:2])
    tol = min(max_tolerance, max(min_tolerance, noise))
    held = [i for i in ranked if names[i] in prefer and medians[i] <= medians[best] * (1.0 + prefer_margin)]
    if held and held[0] != best:  # the preferred (DDP's reducer) is kept unless beaten by more than the margin
        chosen = min(held, key=lambda i: (list(prefer).index(names[i]), i))
        notes.append(f"{names[best]} {medians[best] * 1e3:.1f} ms is not faster than {names[chosen]} "
                     f"{medians[chosen] * 1e3:.1f} ms by more than {prefer_margin:.0%}: chose {names[chosen]}")
        return chosen, medians, notes
    tied = [i for i in ranked if medians[i] <= medians[best] * (1.0 + tol)]
    if len(tied) > 1:
        rank_of = {n: k for k, n in enumerate(prefer)}
        chosen = min(tied, key=lambda i: (rank_of.get(names[i], len(prefer)), i))
        why = "the fastest" if chosen == best else "by preference"
        notes.append(f"within noise ({tol:.0%}) of the fastest: " + ", ".join(
            f"{names[i]} {medians[i] * 1e3:.1f} ms" for i in tied) + f"; chose {names[chosen]} ({why})")
        best = chosen
    return best, medians, notes



#: the choice of one selection: ``(chosen index, median of all windows per candidate (s; inf when unmeasured),
#: the median the choice was made on per candidate (s), where each candidate was decided, notes)``
Choice = tuple[int, list[float], list[float], list[str], list[str]]


class Selection:
    """The rules and results of measured plan selection (the TRIAL phase of the controller).

    Args:
        effects: the controller's :class:`~lightning_pipedap.strategy.controller.Effects` (``agree``, ``info``).
        chooser: :func:`choose_candidate`, or what replaces it (the controller passes one that looks up
            ``controller.choose_candidate`` at each call, which tests replace).
        trial_steps, trial_window_s, trial_rounds, race_drop, prefer_margin, asked: as the controller's arguments.

    Attributes:
        window_steps: measured steps per trial (or verification) window, set when TRIAL (VERIFY) starts.
        trial_results: one dict per measured candidate of the last *finished* selection (name, describe,
            predicted_s, measured_s (median of all its windows, s), deciding_s (the median the choice was made
            on, s: of the confirmation windows for the two candidates a confirmation compared, else of all
            windows), decided_in (``"first pass"`` or ``"confirmation"``), chosen, windows_s, steps_s, plus
            ``predictions[name]``); kept across a re-plan until the next selection finishes (see
            :meth:`Controller.plan_selection` for one left unfinished).
        selections: ``trial_results`` of every finished selection of this fit, oldest first.
        selection_notes: why the last finished selection chose as it did, in words (:func:`choose_candidate`'s
            notes: a confirmation's numbers, DDP's reducer kept within its margin, ties within noise, candidates
            below the physical floor); kept with ``trial_results``.
    """

    def __init__(self, effects: Any, chooser: Callable[..., tuple[int, list[float], list[str]]], *, trial_steps: int,
                 trial_window_s: float, trial_rounds: int, race_drop: Optional[float], prefer_margin: float,
                 asked: str) -> None:
        self.effects, self.chooser = effects, chooser
        self.trial_steps, self.trial_window_s, self.trial_rounds = trial_steps, trial_window_s, trial_rounds
        self.race_drop, self.prefer_margin = race_drop, prefer_margin
        self.asked = asked  # the schedule the user named (for "asked: X -> running: Y")
        self.window_steps = trial_steps
        self.trial_results: list[dict[str, Any]] = []
        self.selections: list[list[dict[str, Any]]] = []
        self.selection_notes: list[str] = []

    # ------------------------------------------------------------------ windows
    def _window_steps(self, step_s: Optional[float]) -> int:
        """Measured steps of one trial (or verification) window: ``trial_steps``, more for short steps
        (``trial_window_s``), at most :data:`MAX_WINDOW_STEPS` (``step_s``: the no-overlap time, identical on every
        rank)."""
        longer = math.ceil(self.trial_window_s / step_s) if step_s and step_s > 0 and self.trial_window_s > 0 else 0
        return max(self.trial_steps, min(MAX_WINDOW_STEPS, longer))

    def begin(self, schedules: list[Any], no_overlap: list[float], left: Optional[int],
              budget: Optional[int]) -> Trial:
        """A selection among ``schedules`` (two or more) starts: size its windows (shorter to fit the ``left``
        steps of the start-up budget of ``budget`` steps, None without one), say so, and return its :class:`Trial`."""
        n, rounds = len(schedules), self.trial_rounds
        self.window_steps = self._window_steps(no_overlap[0])
        fits = ""
        if left is not None and n * rounds * (self.window_steps + 1) > left:  # (shorter windows fit the budget)
            self.window_steps = max(MIN_BUDGET_WINDOW, min(self.window_steps, left // (n * rounds) - 1))
            fits = f", shortened to fit the start-up budget of {steps_text(budget)}"
        self.effects.info(f"pipedap: measuring {n} candidate schedules for {self.window_steps} "
                          f"measured steps each (after one settling step per window{fits})"
                          f"{self._rounds_text(rounds)}: "
                          f"{', '.join(s.name for s in schedules)}")
        return Trial(list(schedules), list(no_overlap), order=list(range(n)), gaps_s=[[] for _ in range(n)],
                     alive=list(range(n)))

    def _rounds_text(self, rounds: int) -> str:
        if rounds < 2:
            return ""
        if self.race_drop is None:
            return f" in {rounds} interleaved rounds"
        return (f" in up to {rounds} interleaved rounds, a candidate dropped once it is more than "
                f"{self.race_drop:.0%} slower than the fastest")

    def planned_windows(self, tr: Trial) -> int:
        """Windows of the selection as planned now: those in ``order`` plus the rounds still to come of the
        candidates left in the race (before a confirmation adds any)."""
        if tr.confirm is not None:
            return len(tr.order)
        return len(tr.order) + max(0, self.trial_rounds - tr.rounds_done - 1) * len(tr.alive)

    def race(self, tr: Trial) -> bool:
        """After a round of windows: drop the candidates slower than the fastest by more than :data:`RACE_DROP`
        (medians of their windows so far, rank 0's), and append another round of those left while fewer than
        ``trial_rounds`` rounds ran and two or more are left (in trial order).
        Returns whether a round was appended."""
        tr.rounds_done += 1
        if tr.rounds_done >= self.trial_rounds or len(tr.alive) < 2:
            return False
        out: list[int] = []
        if self.race_drop is not None:
            windows = self.effects.agree([[lower_quartile(g[1:]) for g in per] for per in tr.gaps_s])
            med = {i: statistics.median(windows[i]) for i in tr.alive if windows[i]}
            lead = min(med, key=med.__getitem__) if med else None
            if lead is not None:  # (never DDP's reducer: only torch_ddp_margin and a confirmation displace it)
                out = [i for i in tr.alive if i in med and med[i] > med[lead] * (1.0 + self.race_drop)
                       and tr.schedules[i].name not in PREFERRED]
        if out:
            assert lead is not None and self.race_drop is not None
            note = (f"racing, after round {tr.rounds_done}: dropped " + ", ".join(
                f"{tr.schedules[i].name} {med[i] * 1e3:.1f} ms" for i in out)
                + f" (more than {self.race_drop:.0%} slower than {tr.schedules[lead].name} {med[lead] * 1e3:.1f} ms)")
            tr.dropped.append(note)
            self.effects.info(f"pipedap: {note}")
        tr.alive = [i for i in tr.alive if i not in out]
        if len(tr.alive) < 2:
            return False
        tr.order += list(tr.alive)  # (trial order again: a rerun interleaves alike)
        return True

    def window_over(self, tr: Trial, now: float, over: bool) -> bool:
        """A step of ``tr``'s current window starts at ``now`` (s). Returns whether the window is over (its settling
        interval and :attr:`window_steps` measured ones, or ``over``: the start-up budget is spent); its step
        intervals are then kept in ``tr.gaps_s`` (a window cut by the budget when it measured a step after
        settling)."""
        tr.starts.append(now)
        if len(tr.starts) < self.window_steps + 2 and not over:  # the first interval after a switch settles
            return False
        if len(tr.starts) >= 3:  # (a window cut by the budget counts if it measured a step after settling)
            tr.gaps_s[tr.order[tr.window]].append([b - a for a, b in zip(tr.starts[:-1], tr.starts[1:])])
        return True

    def next_window(self, tr: Trial, over: bool) -> bool:
        """After a window is over (and the pending updates were applied): move on; returns whether another window
        follows (``over``: the start-up budget is spent, none does; after a round, :meth:`race`)."""
        tr.window += 1
        return not over and (tr.window < len(tr.order) or (tr.confirm is None and self.race(tr)))

    def finish(self, tr: Trial, over: bool,
               budget_text: str) -> tuple[Optional[Choice], list[list[float]], Optional[str]]:
        """After the last window of ``tr``: rank 0's lower-quartile step of each window per candidate and the
        physical floor (one ``agree``), and :meth:`choose` on them. ``over``: the start-up budget stopped the
        selection (``budget_text``: :meth:`StartupLedger.budget_text`), said in a note. Returns ``(choice or None
        (confirmation windows appended), the windows, the budget note or None)``."""
        windows = [[lower_quartile(g[1:]) for g in per] for per in tr.gaps_s]
        windows, floor = self.effects.agree((windows, self.effects.comm_floor_s()))
        note = None
        if over:
            measured_k = sum(1 for w in windows if w)
            note = (f"{budget_text} ran out after {tr.window} of {self.planned_windows(tr)} windows ({measured_k} "
                    f"of {len(tr.schedules)} candidates measured): the fastest measured so far is installed")
            self.effects.info(f"pipedap: {note}")
        return self.choose(tr, windows, floor, over, tr.order[tr.window - 1]), windows, note

    # ------------------------------------------------------------------ the choice
    def choose(self, tr: Trial, windows: list[list[float]], floor: Optional[float], over: bool,
               installed: int) -> Optional[Choice]:
        """The choice once the last window of ``tr`` was measured (``windows``: rank 0's lower-quartile step of
        each window per candidate; ``floor``: :meth:`Effects.comm_floor_s`; ``over``: the start-up budget stopped
        the selection; ``installed``: the candidate running now). None when the first pass's winner displaces
        DDP's reducer: confirmation windows were appended to ``tr.order`` instead."""
        names = [s.name for s in tr.schedules]
        if over and (tr.confirm is not None or sum(1 for w in windows if w) < len(names)):
            best, measured, deciding, notes = self._choose_measured(tr, names, windows, floor, installed)
            decided_in = ["start-up budget"] * len(names)
        elif tr.confirm is None:
            best, measured, notes = self._choose_alive(tr, names, windows, floor)
            if self._confirm(tr, names, best, measured):
                return None
            deciding, decided_in = list(measured), ["first pass"] * len(names)
        else:
            best, measured, deciding, notes = self._confirmed(tr, names, windows, floor)
            decided_in = ["confirmation" if i in tr.confirm[:2] else "first pass" for i in range(len(names))]
        return best, measured, deciding, decided_in, tr.dropped + notes

    def _choose_measured(self, tr: Trial, names: list[str], windows: list[list[float]], floor: Optional[float],
                         installed: int) -> tuple[int, list[float], list[float], list[str]]:
        """The choice when the start-up budget stops a selection: among the candidates measured so far (with
        :func:`choose_candidate`); a confirmation cut short keeps the preferred candidate (DDP's reducer), the
        first pass's winner not having beaten it twice; nothing measured keeps the installed one. Returns
        ``(chosen, median per candidate (s; inf when unmeasured), deciding (s), notes)``."""
        measured = [statistics.median(w) if w else math.inf for w in windows]
        if tr.confirm is not None:
            winner, pref, first = tr.confirm
            if not windows[winner][first:] or not windows[pref][first:]:
                return pref, measured, list(measured), [f"confirmation cut by the start-up budget: kept {names[pref]}"]
            best, _, deciding, notes = self._confirmed(tr, names, windows, floor)
            return best, measured, deciding, notes
        if not any(windows):
            return installed, measured, list(measured), [f"nothing measured: kept {names[installed]}"]
        best, measured, notes = self._choose_alive(tr, names, windows, floor)
        return best, measured, list(measured), notes

    def _choose_alive(self, tr: Trial, names: list[str], windows: list[list[float]],
                      floor: Optional[float]) -> tuple[int, list[float], list[str]]:
        """:func:`choose_candidate` among the measured candidates racing did not drop (a dropped one was clearly
        slower; its one window must not win through the floor or a tie rule). Returns ``(chosen, median of every
        candidate's windows (s; inf when unmeasured), notes)``."""
        idx = [i for i in tr.alive if windows[i]] or [i for i, w in enumerate(windows) if w]
        k, _, notes = self.chooser([names[i] for i in idx], [windows[i] for i in idx], floor,
                                   prefer_margin=self.prefer_margin)
        return idx[k], [statistics.median(w) if w else math.inf for w in windows], notes

    def _confirm(self, tr: Trial, names: list[str], best: int, measured: list[float]) -> bool:
        """When the first pass's winner displaces a preferred candidate (DDP's reducer), measure the two again
        in ``trial_rounds`` more interleaved rounds; :meth:`_confirmed` then decides between them on those
        windows alone, so the winner must win twice: a load burst on a shared machine can favour one
        candidate's windows for a whole pass, and a wrong switch away from DDP's reducer costs more than it
        could gain. Returns whether confirmation windows were added."""
        pref = [i for i, n in enumerate(names) if n in PREFERRED]
        if not pref or best in pref or pref[0] not in tr.alive:  # (racing dropped it: > race_drop slower already)
            return False
        tr.confirm = (best, pref[0], self.trial_rounds)
        pair = [pref[0], best] if tr.order[-1] == pref[0] else [best, pref[0]]  # (the installed one first)
        tr.order += pair * self.trial_rounds
        self.effects.info(f"pipedap: {names[best]} measured {measured[best] * 1e3:.1f} ms against "
                          f"{names[pref[0]]} {measured[pref[0]] * 1e3:.1f} ms; confirming in {self.trial_rounds} more "
                          "interleaved round(s) of the two")
        return True

    def _confirmed(self, tr: Trial, names: list[str], windows: list[list[float]],
                   floor: Optional[float]) -> tuple[int, list[float], list[float], list[str]]:
        """The choice after confirmation windows: between the first pass's winner and the preferred candidate,
        from the confirmation windows only. Returns ``(chosen, median of all windows (s), deciding (s), notes)``:
        ``deciding`` is the median of the confirmation windows for the two, of the first pass (their only
        windows) for the others: the numbers the choice was made on."""
        assert tr.confirm is not None
        winner, pref, first = tr.confirm
        pair = [winner, pref]
        k, again, notes = self.chooser([names[i] for i in pair], [windows[i][first:] for i in pair], floor,
                                       prefer_margin=self.prefer_margin)
        notes.insert(0, f"confirmation: {names[winner]} {again[0] * 1e3:.1f} ms, {names[pref]} "
                        f"{again[1] * 1e3:.1f} ms; chose {names[pair[k]]}")
        measured = [statistics.median(w) for w in windows]
        deciding = list(measured)
        deciding[winner], deciding[pref] = again
        return pair[k], measured, deciding, notes

    # ------------------------------------------------------------------ results
    def record(self, tr: Trial, choice: Choice, windows: list[list[float]],
               predictions: dict[str, dict[str, float]]) -> None:
        """Keep a finished selection's ``choice`` as :attr:`trial_results` (one dict per candidate, with its
        ``predictions``), append it to :attr:`selections`, and log the candidates, the notes and what runs."""
        best, measured, deciding, decided_in, notes = choice
        self.trial_results = [
            {"name": s.name, "describe": s.describe(), "predicted_s": s.predicted_iteration_s,
             "measured_s": m if math.isfinite(m) else None,
             "deciding_s": deciding[i] if math.isfinite(deciding[i]) else None, "decided_in": decided_in[i],
             "chosen": i == best, "windows_s": windows[i], "steps_s": tr.gaps_s[i],
             **predictions.get(s.name, {})}
            for i, (s, m) in enumerate(zip(tr.schedules, measured))
        ]
        self.selections.append(self.trial_results)
        self.selection_notes = list(notes)
        self._log_results(tr, best, notes)

    def _log_results(self, tr: Trial, best: int, notes: list[str]) -> None:
        """The lines of a finished selection: every candidate's numbers, the notes (but racing's, logged when they
        happened), and ``asked: X -> running: Y``."""
        confirmed = tr.confirm is not None
        self.effects.info("pipedap: measured candidates (lower-quartile step of each window; the median the choice "
                          "was made on" + (", confirmation rounds for the two confirmed" if confirmed else "")
                          + "): " + "; ".join(
            f"{r['name']} " + ("not measured " if r["deciding_s"] is None else f"{r['deciding_s'] * 1e3:.1f} ms ")
            + (f"[{r['decided_in']}, all windows {r['measured_s'] * 1e3:.1f} ms] "
               if confirmed and r["measured_s"] is not None else "")
            + (f"(predicted {r['predicted_s'] * 1e3:.1f} ms)" if r["predicted_s"] is not None else "(no prediction)")
            + (" <- chosen" if r["chosen"] else "") for r in self.trial_results))
        for note in notes[len(tr.dropped):]:  # (the racing notes were logged when they happened)
            self.effects.info(f"pipedap: {note}")
        first, chosen = self.trial_results[0], self.trial_results[best]
        gain = " (the planner's own plan)" if best == 0 else ""
        if best != 0 and first["deciding_s"] and chosen["deciding_s"]:
            ratio = first["deciding_s"] / chosen["deciding_s"] - 1
            gain = (f" (measured {ratio:.0%} faster than {first['name']})" if ratio > 0 else
                    f" ({first['name']} measured {-ratio:.0%} faster, within the noise or the margin that keeps "
                    f"{chosen['name']}: see the notes above)")
        self.effects.info(f"pipedap: asked: {self.asked or tr.schedules[0].name} -> running: "
                          f"{tr.schedules[best].name}{gain}")

    @staticmethod
    def partial_results(tr: Trial) -> list[dict[str, Any]]:
        """The measurements of ``tr`` so far: see :meth:`Controller.partial_trial_results`."""
        out = []
        for s, per in zip(tr.schedules, tr.gaps_s):
            windows = [lower_quartile(g[1:]) for g in per if len(g) > 1]
            out.append({"name": s.name, "predicted_s": s.predicted_iteration_s, "windows_s": windows,
                        "measured_s": statistics.median(windows) if windows else None, "chosen": False})
        return out

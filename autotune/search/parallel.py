"""Keeping every GPU slot busy: trials run at once on disjoint GPU sets, told as they finish.

A node with M GPUs tuning an N-GPU configuration has M // N slots (``hardware.plan_slots``, following
NVLink and NUMA where NVML shows them). The scheduler asks the policy for a candidate whenever a slot
is free, gates it, claims it against the study's ``--trials`` (``study/claims.py``: every controller
sharing the study counts), and runs it in a thread on that slot's GPUs; outcomes are told to the
study and the planner as they arrive, so the next proposal already knows them. Running trials are
known to the policy (constant liar, pending keys), so K trials asked at once are K candidates.

With one slot this is the plain sequential search. Controllers on other machines (or a second one
on this machine) are cooperated with, not refused: their running trials count against the budget,
their dead trials are taken over (Optuna's heartbeat, ``study/recovery.py``), and a configuration
one of them is measuring is waited for instead of measured twice.
"""

from __future__ import annotations

import logging
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.storages._heartbeat import BaseHeartbeatThread
from optuna.trial import TrialState

from autotune.candidate import constraints
from autotune.errors import SearchStopped
from autotune.runners.base import on_gpus
from autotune.search.state import SearchState, TrialSteps
from autotune.study import candidate_key, launched_rows, rows
from autotune.study.claims import answered, claim, launches, pending_keys
from autotune.study.recovery import Heartbeat, claim_owner, recover_interrupted
from autotune.study.storage import heartbeat_s
from autotune.trial.execute import abort_on_error
from autotune.trial.outcome import Outcome

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often to look at the study while waiting on others
RECOVER_EVERY_S = 10.0  # how often to look for trials whose controller died (at most)


__all__ = ["Asked", "Scheduler", "answered"]  # answered: study/claims.py's, which claim() agrees with


@dataclass
class Asked:
    """A trial asked from the study and held by this controller until it is told."""

    trial: optuna.Trial
    params: dict[str, Any]
    key: str
    heartbeat: BaseHeartbeatThread
    predicted_gib: float | None = None
    slot: int | None = None


class Scheduler:
    """Runs the search's trials on ``slots`` (one GPU list per slot) until the budget or a stop."""

    def __init__(self, state: SearchState, steps: TrialSteps, slots: list[list[int] | None]) -> None:
        """``steps`` gate, measure and tell one trial (:class:`autotune.search.loop.Search`, a layer
        above: known here only by its protocol); ``state`` is what they share with the scheduler."""
        self.state, self.steps, self.study, self.slots = state, steps, state.study, slots
        self.free = list(range(len(slots)))
        self.running: dict[Future, Asked] = {}
        self.waiting: list[Asked] = []  # the same configuration is running elsewhere
        self.last_recover = time.monotonic()
        self.known = {r.number for r in rows(self.study)}  # trials already learned from (Search.open)

    def run(self) -> str | None:
        """Until --trials, a stop condition, or nothing left to do; returns why it stopped (or None)."""
        s = self.state
        stopped: str | None = None
        pool = ThreadPoolExecutor(len(self.slots), thread_name_prefix="trial")
        try:
            with abort_on_error(pool):  # Ctrl-C: running trials stop, and stay unrecorded for resume
                while True:
                    for future in [f for f in self.running if f.done()]:
                        reason = self.finish(self.running.pop(future), future)
                        stopped = stopped or reason
                    if stopped is None:
                        stop = s.stopping.reason()
                        if stop is not None:
                            stopped = f"stopped after {launches(self.study)} trials: {stop[0]}"
                            s.reporter.message(stop[1])
                    if stopped is None:
                        self.recheck_waiting(pool)
                    else:  # nothing new is launched once the search stopped
                        self.drop_waiting(stopped)
                    if (
                        stopped is None
                        and self.free
                        and len(self.waiting) < len(self.slots)
                        and self.budget_left()
                    ):
                        self.ask(pool)
                        continue
                    if self.running:
                        wait(list(self.running), timeout=POLL_S * 4, return_when=FIRST_COMPLETED)
                        self.recover()
                        continue
                    if self.waiting or (stopped is None and self.others_running()):
                        time.sleep(POLL_S)
                        self.recover()
                        continue
                    return stopped
        except SearchStopped as exc:  # the same crash again: held candidates are closed, not left RUNNING
            self.drop_waiting(f"search stopped: {exc}")
            raise
        finally:  # every heartbeat stops, whatever ends the search (a live one keeps its trial RUNNING)
            for asked in [*self.running.values(), *self.waiting]:
                asked.heartbeat.join()

    # -- asking -------------------------------------------------------------------------------
    def budget_left(self) -> bool:
        """Launches left in the study's --trials (anyone's), or a queued re-run waiting."""
        if launches(self.study) < self.state.recipe.trials:
            return True
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def others_running(self) -> bool:
        """Whether another controller still runs trials of this study (their failure re-queues work)."""
        mine = {a.trial.number for a in [*self.running.values(), *self.waiting]}
        return any(
            t.number not in mine for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        )

    def ask(self, pool: ThreadPoolExecutor) -> None:
        """Ask one candidate, gate it, and launch it on a free slot (or answer it, or hold it)."""
        s = self.state
        try:
            with (
                warnings.catch_warnings()
            ):  # Optuna expects heartbeats with optimize(); ask/tell use them too
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = self.study.ask()
            claim_owner(self.study, trial)  # (the policy sampler did already; any other sampler too)
        except optuna.exceptions.UpdateFinishedTrialError:
            log.info("a trial was taken over by another controller while it was being asked; asking again")
            return
        heartbeat = Heartbeat(trial._trial_id, self.study._storage)  # noqa: SLF001  (outlives a failed write)
        heartbeat.start()
        try:
            params = s.space.normalize(constraints.derive(s.space.suggest(trial, s.fixed), s.recipe))
            asked = Asked(trial, params, candidate_key(params), heartbeat)
            self.gate_and_launch(asked, pool)
        except optuna.exceptions.UpdateFinishedTrialError:
            self.release_unless_held(trial, heartbeat)
            log.info("trial %d was taken over by another controller before it launched", trial.number)
        except BaseException:
            self.release_unless_held(trial, heartbeat)
            raise

    def release_unless_held(self, trial: optuna.Trial, heartbeat: BaseHeartbeatThread) -> None:
        """Stop a trial's heartbeat unless it is running or waiting here (then whoever ends it does)."""
        if not any(a.trial is trial for a in [*self.running.values(), *self.waiting]):
            heartbeat.join()

    def learn_from_others(self) -> None:
        """Feed the planner what other controllers measured since it last looked, so that a node's
        proposals know the whole study's outcomes, not only its own."""
        for row in rows(self.study):
            if row.number in self.known:
                continue
            self.known.add(row.number)
            self.state.observe_row(row)

    def gate_and_launch(self, asked: Asked, pool: ThreadPoolExecutor) -> None:
        self.learn_from_others()
        outcome, asked.predicted_gib = self.steps.gate(
            asked.trial.number, asked.params, answered(self.study).get(asked.key)
        )
        if outcome is not None:
            self.tell(asked, outcome)
            return
        granted = claim(self.study, asked.trial, asked.params, asked.key, self.state.recipe.trials)
        if granted.why == "measured":  # told by another controller since the gate looked: answer it
            self.gate_and_launch(asked, pool)  # (claim and the gate read the same answered())
            return
        if granted.why == "running":
            log.info(
                "trial %d: the same configuration is being measured by trial %d; waiting for it",
                asked.trial.number,
                granted.other,
            )
            self.waiting.append(asked)
            return
        if not granted.granted:
            self.drop(asked, "not launched: the study's --trials were used up by other controllers meanwhile")
            return
        asked.slot = self.free.pop(0)
        number = launches(self.study)
        self.running[pool.submit(self.execute, asked, number)] = asked

    def execute(self, asked: Asked, number: int) -> Outcome:
        """In a worker thread: run the trial on its slot's GPUs."""
        with on_gpus(self.slots[asked.slot]):
            return self.steps.measure(asked.trial, asked.params, number, asked.predicted_gib)

    def recheck_waiting(self, pool: ThreadPoolExecutor) -> None:
        """Answer a held candidate once its twin is measured, or launch it if its twin died."""
        if not self.waiting:
            return
        done, running = answered(self.study), pending_keys(self.study)
        for asked in list(self.waiting):
            if asked.key in done or asked.key not in running:
                if asked.key not in done and not self.free:
                    continue
                self.waiting.remove(asked)
                try:
                    self.gate_and_launch(asked, pool)
                except BaseException:
                    self.release_unless_held(asked.trial, asked.heartbeat)
                    raise

    def drop_waiting(self, reason: str) -> None:
        """Close the held candidates of a stopped search (FAIL, never launched), so that none is left
        RUNNING for another controller or a resume to take for an interrupted trial."""
        for asked in list(self.waiting):
            self.waiting.remove(asked)
            try:
                self.drop(asked, f"not launched: {reason}")
            except Exception as exc:  # a storage error must not hide why the search stopped
                log.warning("could not close held trial %d: %s", asked.trial.number, exc)

    # -- telling ------------------------------------------------------------------------------
    def finish(self, asked: Asked, future: Future) -> str | None:
        """Tell a finished trial; returns a stop reason (converged) or None. A SearchStopped (the same
        crash again) propagates after the trial is told."""
        self.free.append(asked.slot)
        self.free.sort()
        try:
            outcome = future.result()
        except BaseException:  # the trial thread failed: its heartbeat must stop, or the process never exits
            asked.heartbeat.join()
            raise
        self.tell(asked, outcome)
        if outcome.launched:
            reason = self.steps.converged(len(launched_rows(self.study)))
            if reason:
                self.state.reporter.message(reason)
                return reason
        return None

    def tell(self, asked: Asked, outcome: Outcome) -> None:
        self.known.add(asked.trial.number)
        try:
            self.steps.tell(asked.trial, asked.params, asked.key, outcome)
        except optuna.exceptions.UpdateFinishedTrialError:
            log.warning(
                "trial %d was taken over by another controller (its heartbeat was late); its result "
                "stays in %s only",
                asked.trial.number,
                self.state.paths.trial_dir(asked.trial.number),
            )
        finally:
            asked.heartbeat.join()

    def drop(self, asked: Asked, reason: str) -> None:
        """Close an asked trial that will not run (as FAIL: the sampler ignores it)."""
        try:
            asked.trial.set_user_attr("reason", reason)
            self.study.tell(asked.trial, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass
        finally:
            asked.heartbeat.join()

    def recover(self) -> None:
        """Now and then: take over trials whose controller died (this machine's, or heartbeat-stale)."""
        if time.monotonic() - self.last_recover < min(RECOVER_EVERY_S, heartbeat_s()):
            return
        self.last_recover = time.monotonic()
        recover_interrupted(self.study, self.state.paths)

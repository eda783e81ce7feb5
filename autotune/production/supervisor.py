"""Running the production run: launch, watch, classify, restart from the newest checkpoint.

Each attempt is launched by the study's runner in its own process group through the trial
machinery (:func:`autotune.trial.execute.execute`): the same watch (metrics, log lines, hang and
time limits) and the same classification (OOM kinds, hang, crash) as every trial. An attempt that
dies of OOM or hangs is recorded as an incident in the study and the run goes on from the newest
checkpoint on a safer configuration (:mod:`autotune.production.choice`); a crash that is not about
memory is restarted once on the same configuration. ``--max-restarts`` bounds the restarts. Ctrl-C
and SIGTERM are passed to the trainer as SIGTERM (so it can save) and the run stops; ``autotune run``
again goes on from the newest checkpoint, on the configuration the run was last on (state.json).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.files import write_json
from autotune.production.checkpoints import newest
from autotune.production.choice import Choice, restart_choice
from autotune.production.launchers import prepare_attempt
from autotune.runners.base import Runner
from autotune.search.planner import Planner
from autotune.study.incidents import Incident, incidents, save_incident
from autotune.study.record import rows as study_rows
from autotune.trial.control import StopRule, TrialControl
from autotune.trial.execute import execute, fresh_trial_dir
from autotune.trial.layout import METRICS, OUTCOME
from autotune.trial.outcome import Outcome, Status
from autotune.trial.processes import marked_processes

log = logging.getLogger(__name__)

STATE = "state.json"
PROBE_NUMBER_OFFSET = 300_000  # numbers of the run's attempts and probes, apart from trials
#: how an attempt's end is recorded as it is; every other end (a crash, a signal, a bad exit) is a crash
RESTARTED_AS_IS = frozenset({Status.OOM, Status.HANG, Status.TIMEOUT})
EVERY_STEP = 10**9  # the stop rule's measured steps: a production run is never stopped as measured


@dataclass
class RunOptions:
    steps: int
    max_restarts: int = 3
    save_steps: int = 0  # 0: a default that costs little (see :func:`default_save_steps`)
    memory_limit_gib: float | None = None


@dataclass
class RunResult:
    finished: bool
    exit_code: int
    lines: list[str]


def default_save_steps(steps: int) -> int:
    """About twenty checkpoints over the run, never more often than every step: an OOM loses at
    most a twentieth of the run, and saving costs a twentieth as often as logging."""
    return max(1, steps // 20)


def failed_step(attempt_dir: Path, outcome: Outcome, resumed_at: int = 0) -> int:
    """The optimizer step the attempt died in: one past the last step the trainer reported (its
    global step, which a resumed run continues), so "OOM at step 8" is resumed from checkpoint-7.
    An attempt resumed from checkpoint-N that died before reporting a step died in step N + 1
    (the trial's own step count, which starts again at 0, says nothing then)."""
    step = 0
    try:
        for line in (attempt_dir / METRICS).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                step = max(step, int(json.loads(line).get("step") or 0))
    except OSError:
        pass
    return (max(step, resumed_at) if step or resumed_at else outcome.steps) + 1


class Stop(Exception):
    """Ctrl-C or SIGTERM reached the run: the trainer was told, the run ends once it has exited."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Supervisor:
    """The production run of one study (``runs/<study>/run/``)."""

    def __init__(
        self, study: Any, recipe: Any, runner: Runner, space: Space, planner: Planner, root: Path
    ) -> None:
        self.study, self.recipe, self.runner, self.space, self.planner = study, recipe, runner, space, planner
        self.root = root
        self.fixed = {**{k: v for k, v in runner.forced().items() if k not in recipe.pins}, **recipe.pins}
        self.rules = runner.rules()
        self.attempt_dir: Path | None = None
        self.signalled: int | None = None

    # -- state --------------------------------------------------------------------------------
    def load_state(self, exported: dict[str, Any]) -> dict[str, Any]:
        path = self.root / STATE
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
        return {"params": exported, "source": "best/params.json"}

    def next_attempt(self) -> int:
        folder = self.root / "attempts"
        return 1 + max((int(p.name) for p in folder.glob("*") if p.name.isdigit()), default=0)

    # -- signals ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forwarding(self) -> Iterator[None]:
        """SIGINT and SIGTERM go to the trainer as SIGTERM; a second one stops at once."""

        def handler(signum: int, frame: Any) -> None:
            if self.signalled is not None:
                raise KeyboardInterrupt  # the launcher kills the group
            self.signalled = signum
            if self.attempt_dir is not None:
                for proc in marked_processes(self.attempt_dir):
                    with contextlib.suppress(Exception):
                        proc.send_signal(signal.SIGTERM)

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, previous in old.items():
                signal.signal(sig, previous)

    # -- one attempt --------------------------------------------------------------------------
    def attempt(
        self, params: dict[str, Any], opts: RunOptions, *, probe: bool = False
    ) -> tuple[Outcome, int]:
        number = self.next_attempt()
        folder = self.root / ("probes" if probe else "attempts") / str(number)
        if probe:
            number = 1 + max((int(p.name) for p in folder.parent.glob("*") if p.name.isdigit()), default=0)
            folder = folder.parent / str(number)
        folder.mkdir(parents=True, exist_ok=True)
        fresh_trial_dir(folder)
        resume = None if probe else newest(self.root)
        if probe:
            rule = StopRule.searching(self.recipe)
            spec = prepare_attempt(
                self.runner,
                params,
                folder,
                PROBE_NUMBER_OFFSET + number,
                steps=rule.warmup + rule.measure + rule.extra + 1,
                save_steps=10**6,
                resume=None,
                memory_limit_gib=opts.memory_limit_gib,
            )
            recipe = self.recipe
        else:
            rule = StopRule(warmup=self.recipe.warmup_steps, measure=EVERY_STEP, adaptive=False, prune=False)
            spec = prepare_attempt(
                self.runner,
                params,
                folder,
                PROBE_NUMBER_OFFSET + number,
                steps=opts.steps,
                save_steps=opts.save_steps or default_save_steps(opts.steps),
                resume=resume,
                memory_limit_gib=opts.memory_limit_gib,
            )
            recipe = replace(self.recipe, trial_timeout_s=float("inf"))  # a run ends when it is done
        write_json(folder / "params.json", params)
        if resume is not None:
            (folder / "resumed_from.txt").write_text(f"{resume.path}\n")
        control = TrialControl(
            rule, None, constraints.samples_per_step(params, self.recipe, self.space), purpose="run"
        )
        self.attempt_dir = folder
        try:
            outcome = execute(
                spec,
                params,
                recipe,
                control,
                monitors_gpus=self.runner.monitors_gpus,
                services=self.runner.services(spec),
            )
        finally:
            self.attempt_dir = None
        if self.signalled is not None and outcome.status == Status.CRASH:
            # it ended because this run passed on a SIGTERM or Ctrl-C, not of a crash of its own
            name = signal.Signals(self.signalled).name
            outcome = replace(
                outcome, status=Status.INTERRUPTED, error_line=f"{name}, passed on by autotune run"
            )
            outcome.write(folder / OUTCOME)
        return outcome, number

    # -- the run ------------------------------------------------------------------------------
    def run(self, exported: dict[str, Any], opts: RunOptions) -> RunResult:
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.load_state(exported)
        params = dict(state["params"])
        restarts, transient_used = 0, False
        met: list[Incident] = []
        with self.forwarding():
            while True:
                done = newest(self.root)
                if done is not None and done.step >= opts.steps:
                    return RunResult(True, 0, [f"finished: checkpoint-{done.step} ({done.path})"])
                write_json(self.root / STATE, {"params": params, "source": state.get("source")})
                print(
                    f"run attempt {self.next_attempt()}: {params} "
                    + (f"resuming from {done.path}" if done else "from the start"),
                    flush=True,
                )
                outcome, number = self.attempt(params, opts)
                if self.signalled is not None:
                    name = signal.Signals(self.signalled).name
                    kept = newest(self.root)
                    where = f" from {kept.path.name}" if kept else ""
                    return RunResult(
                        False,
                        128 + self.signalled,
                        [f"stopped by {name}: the trainer got SIGTERM; autotune run again goes on{where}"],
                    )
                if outcome.returncode == 0:
                    kept = newest(self.root)
                    tail = f"; newest checkpoint {kept.path}" if kept else ""
                    return RunResult(True, 0, [f"finished {opts.steps} steps in attempt {number}{tail}"])
                step = failed_step(self.root / "attempts" / str(number), outcome, done.step if done else 0)
                status = outcome.status if outcome.status in RESTARTED_AS_IS else Status.CRASH
                choice: Choice | None = None
                if restarts < opts.max_restarts:
                    if status == Status.CRASH and transient_used:
                        choice = None
                    else:
                        choice = self.choose(params, status, outcome.oom_kind, met, opts)
                resume = newest(self.root)
                incident = Incident(
                    number=len(incidents(self.study)) + 1,
                    attempt=number,
                    status=status,
                    oom_kind=outcome.oom_kind if status == "oom" else None,
                    step=step,
                    error_line=outcome.error_line or outcome.detail,
                    params=dict(params),
                    resumed_from=str(resume.path) if (resume and choice) else None,
                    switched_to=dict(choice.params) if choice else None,
                    source=choice.source if choice else None,
                )
                save_incident(self.study, incident)
                met.append(incident)
                print(f"production run {incident.line()}", flush=True)
                if choice is None:
                    why = (
                        f"--max-restarts {opts.max_restarts} spent"
                        if restarts >= opts.max_restarts
                        else "a second crash"
                        if status == Status.CRASH
                        else "no measured or proposed configuration needs less memory"
                    )
                    return RunResult(False, 1, [f"stopped ({why}):"] + [f"  {i.line()}" for i in met])
                transient_used = transient_used or status == Status.CRASH
                restarts += 1
                params, state = dict(choice.params), {"source": choice.source}

    def choose(
        self, failed: dict[str, Any], status: str, oom_kind: str | None, met: list[Incident], opts: RunOptions
    ) -> Choice | None:
        """The restart's configuration; a proposed one must first pass a short trial."""
        history = incidents(self.study)
        all_rows = study_rows(self.study)
        for _ in range(3):  # at most three proposals tried as short trials
            choice = restart_choice(
                failed,
                status,
                oom_kind,
                rows=all_rows,
                history=history,
                planner=self.planner,
                space=self.space,
                fixed=self.fixed,
                rules=self.rules,
            )
            if choice is None or not choice.probe:
                return choice
            outcome, number = self.attempt(choice.params, opts, probe=True)
            print(f"probe {number}: {outcome.status} {outcome.error_line or ''}".rstrip(), flush=True)
            if outcome.status == "ok":
                return Choice(choice.params, f"probe {number}, {outcome.throughput:.3g} completions/s")
            self.planner.observe(-1000 - number, choice.params, outcome.status, outcome.oom_kind, None)
            history = history + [
                Incident(0, 0, outcome.status, outcome.oom_kind, 0, outcome.error_line, dict(choice.params))
            ]
        return None

"""What a candidate means to a trainer driven through a command template (``--command``).

The template is split like a shell would split it, once; each candidate's values are put into the
argv elements as plain strings (no shell sees them). The trial runner
(:mod:`autotune.runners.command`) and the export (``best/command.sh``) fill the same table, so what
ships is what the trials ran.
"""

from __future__ import annotations

import re
import shlex
import string
from pathlib import Path
from typing import Any

from autotune.candidate.batch import GlobalBatch, completions_per_step
from autotune.errors import UsageError
from autotune.recipe import Recipe
from autotune.trial.layout import TrialFiles

# placeholders that are not search parameters
EXTRA_FIELDS = (
    "model",
    "gpus",
    "num_processes",
    "trial_dir",
    "metrics_file",
    "deepspeed_config",
    "max_prompt_length",
    "max_completion_length",
    "max_length",
    "global_batch",
    "beta",
    "lora_rank",
    "max_steps",
    "master_port",
)
#: ``{master_port}`` in the export (best/command.sh runs alone on its node): torch's own default.
DEFAULT_MASTER_PORT = 29500


def template_fields(template: str) -> tuple[list[str], list[set[str]]]:
    """Split a template into argv tokens and the placeholder names of each token.

    ``{name}`` and ``{name:SPEC}`` (a Python format spec, applied to the value itself: ``{lr:.1e}``,
    ``{seed:03d}``) are placeholders; a conversion (``{name!r}``), an attribute or index
    (``{name.x}``) or a placeholder inside a spec is refused, since none is needed to write a value.
    """
    try:
        tokens = shlex.split(template)
    except ValueError as exc:
        raise UsageError(f"--command cannot be split like a shell line: {exc}") from None
    if not tokens:
        raise UsageError("--command is empty: give the trainer's command line")
    names: list[set[str]] = []
    for token in tokens:
        found = set()
        for field_name, spec, conv in placeholders(token):
            if not field_name.isidentifier():
                raise UsageError(f"--command placeholder {{{field_name}}} is not a plain name")
            if conv:
                raise UsageError(
                    f"--command placeholder {{{field_name}!{conv}}}: conversions are not supported; "
                    f"write {{{field_name}}} or {{{field_name}:SPEC}}"
                )
            if "{" in spec or "}" in spec:
                raise UsageError(
                    f"--command placeholder {{{field_name}:{spec}}}: a format spec cannot hold "
                    "another placeholder"
                )
            found.add(field_name)
        names.append(found)
    return tokens, names


def placeholders(token: str) -> list[tuple[str, str, str | None]]:
    """(name, spec, conversion) of each placeholder of one argv token, in order."""
    try:
        parsed = list(string.Formatter().parse(token))
    except ValueError as exc:
        raise UsageError(
            f"--command token {token!r}: {exc} (write a literal brace as {{{{ or }}}})"
        ) from None
    return [(name, spec or "", conv) for _, name, spec, conv in parsed if name is not None]


def format_value(value: Any) -> str:
    """How a value appears on a command line: true/false for booleans, shortest float text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)


class Verbatim(str):
    """Text put in place of a placeholder as it is, whatever its format spec (the export's shell
    variables)."""


class Filler(string.Formatter):
    """``str.format`` with autotune's value text: ``{name}`` as :func:`format_value` writes it,
    ``{name:SPEC}`` as Python's ``format(value, SPEC)`` does."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Verbatim):
            return str(value)
        return format(value, format_spec) if format_spec else format_value(value)


def fill(tokens: list[str], values: dict[str, Any]) -> list[str]:
    """The argv: every token with its placeholders replaced by the candidate's values."""
    filler = Filler()
    return [filler.format(token, **values) for token in tokens]


MAX_SPEC_WIDTH = 4096  # an argv string may be 128 KiB (MAX_ARG_STRLEN); a filled value far less


def check_specs(tokens: list[str], samples: dict[str, list[Any]]) -> None:
    """Refuse, before any trial, a format spec that cannot write one of a placeholder's values
    (``{offload:03d}`` on 'none'), rather than crash in the middle of the search."""
    for token in tokens:
        for name, spec, _ in placeholders(token):
            widest = max((int(n) for n in re.findall(r"\d+", spec)), default=0)
            if widest > MAX_SPEC_WIDTH:  # 1e11 is a MemoryError, 140000 an argv the kernel refuses
                raise UsageError(
                    f"--command placeholder {{{name}:{spec}}}: a width or precision of {widest} is more "
                    f"than an argument can hold (at most {MAX_SPEC_WIDTH}): fix the format spec"
                )
            for value in samples.get(name, []) if spec else []:
                try:
                    format(value, spec)
                except (ValueError, TypeError, OverflowError, MemoryError) as exc:
                    raise UsageError(
                        f"--command placeholder {{{name}:{spec}}} cannot write "
                        f"{name}={format_value(value)} ({exc}): fix the format spec or write {{{name}}}"
                    ) from None


def placeholder_values(
    recipe: Recipe,
    params: dict[str, Any],
    trial_dir: Path,
    *,
    model: str,
    batch: GlobalBatch | None,
    max_steps: int,
    master_port: int = DEFAULT_MASTER_PORT,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every placeholder's value for one candidate: its parameters and the recipe's fields. The
    export fills the same table, so best/command.sh is what the trials ran; ``master_port`` is a
    trial's own free port (parallel trials must not share torch's rendezvous port), the export's
    torch's default. ``defaults`` (the space's) fill the placeholder of a parameter the candidate
    lacks because its ``requires`` is not met (a recompute granularity with checkpointing off): the
    trainer is handed a value that does not matter there, where the template had raised KeyError."""
    return {
        **(defaults or {}),
        **params,
        "model": model,
        "gpus": recipe.gpus,
        "num_processes": recipe.dp_gpus(params),
        "trial_dir": trial_dir,
        "metrics_file": TrialFiles(trial_dir).metrics,
        "max_prompt_length": recipe.max_prompt_length,
        "max_completion_length": recipe.max_completion_length,
        "max_length": recipe.max_prompt_length,
        "global_batch": recipe.global_batch or completions_per_step(params, recipe, batch) or 0,
        "beta": recipe.beta,
        "lora_rank": recipe.lora_rank or 0,
        "max_steps": max_steps,  # the trial's length: warm-up and measured steps (confirmations: more)
        "deepspeed_config": trial_dir / "ds_config.json",
        "master_port": master_port,
    }

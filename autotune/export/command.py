"""best/command.sh: the winner's filled ``--command`` template, for a trainer autotune drives by template.

The same template and the same value table (:func:`autotune.configs.command.placeholder_values`)
that built every trial's argv build the script, so what ships is the command that was measured.
Values that only make sense for a trial become shell variables set at the top of the script, each
with a comment: the trial folder (``{trial_dir}``) is the run's output folder, the metrics file
sits in it, and ``{max_steps}`` defaults to the length of autotune's confirmation run, marked as
the value to set for a real run. Each may be overridden from the environment.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from autotune import configs
from autotune.candidate.constraints import space_of
from autotune.configs.command import Verbatim, fill, placeholder_values, template_fields
from autotune.errors import UsageError
from autotune.export.layout import COMMAND_SH, DS_JSON
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.study.record import TrialRow
from autotune.trial.control import StopRule
from autotune.trial.layout import METRICS

# placeholder -> the shell variable that stands for it in command.sh
SHELL_VARS = {
    "trial_dir": "OUTPUT_DIR",
    "metrics_file": "METRICS_FILE",
    "max_steps": "MAX_STEPS",
    "deepspeed_config": "DS_CONFIG",
}
_MARK = "\x00"


def command_files(
    params: dict[str, Any], recipe: Recipe, best: TrialRow, written: dict[str, tuple[str, bool]]
) -> dict[str, tuple[str, bool]]:
    """command.sh, and the DeepSpeed JSON the template points at when the export has not written
    one (the trials got ``configs.deepspeed_config`` as it is, also without ZeRO)."""
    if recipe.runner != "command" or not recipe.command:
        return {}
    out = {COMMAND_SH: (command_sh(params, recipe, best), True)}
    _, fields = template_fields(recipe.command)
    if "deepspeed_config" in set().union(*fields) and DS_JSON not in written:
        out[DS_JSON] = (json.dumps(configs.deepspeed_config(params, recipe), indent=2) + "\n", False)
    return out


def command_sh(params: dict[str, Any], recipe: Recipe, best: TrialRow) -> str:
    """The script's text: trial-only values as marked shell variables, then the filled template."""
    assert recipe.command
    tokens, fields = template_fields(recipe.command)
    used = set().union(*fields)
    space = space_of(recipe)
    confirming = StopRule.confirming(recipe)
    confirm_steps = confirming.warmup + confirming.measure
    values = placeholder_values(
        recipe,
        params,
        Path("."),
        model=_model(recipe),
        batch=space.batch if space is not None else None,
        max_steps=confirm_steps,
        defaults=space.defaults() if space is not None else None,
    )
    values.update({name: Verbatim(f"{_MARK}{var}{_MARK}") for name, var in SHELL_VARS.items()})
    argv = [_quote(token) for token in fill(tokens, values)]
    lines = [
        "#!/usr/bin/env bash",
        f"# The configuration autotune chose (trial {best.number}): "
        "the --command template filled with its values.",
        "# Trial-only values are the variables below, set as a real run would use them; override any of",
        "# them from the environment (MAX_STEPS=1000 ./command.sh). Extra arguments are appended.",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'OUTPUT_DIR="${OUTPUT_DIR:-$HERE/run}"    '
        "# {trial_dir}: each trial had its own folder; the run writes here",
        f'METRICS_FILE="${{METRICS_FILE:-$OUTPUT_DIR/{METRICS}}}"    '
        "# {metrics_file}: where autotune read steps",
    ]
    if "max_steps" in used:
        lines.append(
            f'MAX_STEPS="${{MAX_STEPS:-{confirm_steps}}}"    # {{max_steps}}: SET THIS to your run\'s '
            f"length; {confirm_steps} is what autotune's confirmation run trained"
        )
    if "deepspeed_config" in used:
        lines.append(f'DS_CONFIG="$HERE/{DS_JSON}"    # {{deepspeed_config}}: the JSON beside this script')
    lines += [
        'mkdir -p "$OUTPUT_DIR"',
        "# the trial contract's environment (a trainer that writes autotune's metrics reads it)",
        'export AUTOTUNE_TRIAL_DIR="$OUTPUT_DIR" AUTOTUNE_METRICS_FILE="$METRICS_FILE"',
        f"export NPROC_PER_NODE={recipe.dp_gpus(params)}",
    ]
    if recipe.device != "cpu":
        gpus = ",".join(str(i) for i in range(recipe.gpus))
        lines.append(f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES:-{gpus}}}"')
    if recipe.workdir:
        lines.append(
            f"cd {shlex.quote(recipe.workdir)}    # where the trials ran: relative paths resolve here"
        )
    body: list[str] = []
    for token in argv:
        if body and not token.startswith("-") and len(body[-1].split()) == 1 and body[-1].startswith("-"):
            body[-1] += " " + token  # a flag and its value on one line
        else:
            body.append(token)
    lines.append("exec " + " \\\n  ".join(body + ['"$@"']))
    return "\n".join(lines) + "\n"


def _quote(token: str) -> str:
    """Shell-quote a filled token, leaving its shell variables (between markers) expanded."""
    parts = token.split(_MARK)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f'"${{{part}}}"')
        elif part or len(parts) == 1:
            out.append(shlex.quote(part))
    return "".join(out)


def _model(recipe: Recipe) -> str:
    """The model as the trials named it: the local folder it resolved to, else the name given."""
    try:
        return str(resolve_model(recipe.model).path or recipe.model)
    except UsageError:
        return recipe.model

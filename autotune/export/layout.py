"""The export's folder, ``best/``: its file names and what each one is, in one place.

Why: the writer must know which files are its own (an existing folder keeps every other file),
summary.md lists them with a line each, and the scripts refer to each other by name; a name
spelled in each of those modules drifts. docs/trial-contract.md describes the study folder.
"""

from __future__ import annotations

PARAMS_JSON = "params.json"
GRPO_YAML = "grpo_config.yaml"
DS_JSON = "ds_config.json"
ACCELERATE_YAML = "accelerate_config.yaml"
LAUNCH_SH = "launch.sh"
SWIFT_SH = "swift.sh"
COMMAND_SH = "command.sh"
SUMMARY_MD = "summary.md"

# every file autotune writes into best/, with the line summary.md gives it
BEST_FILES: dict[str, str] = {
    PARAMS_JSON: "the tuned parameter values",
    GRPO_YAML: "trl.GRPOConfig fields (`--config`)",
    DS_JSON: "DeepSpeed config; batch sizes and precision are `auto`, filled from the GRPO config",
    ACCELERATE_YAML: "`accelerate launch --config_file`",
    LAUNCH_SH: "TRL + accelerate launcher",
    SWIFT_SH: "the same run with ms-swift",
    COMMAND_SH: "the winner's filled --command template (trial-only values marked at the top)",
    SUMMARY_MD: "this file",
}

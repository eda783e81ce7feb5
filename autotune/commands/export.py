"""``autotune export`` and ``autotune report``: the launch files and the HTML report of a study,
written where asked without touching anything else there."""

from __future__ import annotations

from pathlib import Path

from autotune.commands.opening import open_named
from autotune.errors import UsageError
from autotune.export import export_study
from autotune.study import plain_failures


def export_named(name: str, runs_dir: Path, out: Path | None) -> list[Path]:
    """Write the best trial's launch files into ``out`` (default: the study's best/); the files."""
    paths, recipe, study = open_named(name, runs_dir)
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: give a folder (it keeps whatever else it holds)")
    target = out or paths.best
    with plain_failures(paths, recipe, "export elsewhere with --out DIR", where=target):
        written = export_study(study, recipe, target)
    if not written:
        raise UsageError(f"study '{name}' has no successful trial yet: nothing to export")
    return written


def report_named(name: str, runs_dir: Path, out: Path | None) -> Path:
    """Write the study's report.html (or ``out``); the file written."""
    from autotune.export.report import write_report

    paths, recipe, study = open_named(name, runs_dir)
    if out is not None and out.is_dir():
        raise UsageError(f"--out {out} is a folder: give a file name, e.g. {out / 'report.html'}")
    with plain_failures(paths, recipe, "write the report elsewhere with --out FILE", where=out or paths.root):
        return write_report(study, recipe, paths, out)

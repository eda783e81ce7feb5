"""report.html: the search as plots, for the morning after an overnight search.

One self-contained HTML file (plotly.js inlined, no network), so it opens on a cluster login node
or from a laptop after ``scp``. Every figure is drawn from what the study and the trial folders
already hold: the study's trials (status, throughput, peak, prediction, wall time), the
confirmations, and each trial's gpu.csv. Plotly draws; nothing here hand-draws SVG.
"""

from __future__ import annotations

import ctypes
import html
import time
from pathlib import Path
from typing import Any

import optuna

from autotune.files import write_text
from autotune.recipe import Recipe
from autotune.study import StudyPaths, choose_best, confirmations, rows
from autotune.study.incidents import long_run_failures
from autotune.study.ranking import headroom_limit
from autotune.study.record import TrialRow
from autotune.trial.layout import TrialFiles
from autotune.trial.outcome import read_outcome
from autotune.trial.utilization import read_ticks

REPORT_HTML = "report.html"
MARKERS = {
    "ok": ("circle", "#2a9d8f"),
    "oom": ("x", "#e63946"),
    "skipped": ("triangle-down", "#f4a261"),
    "invalid": ("square-open", "#8d99ae"),
    "timeout": ("diamond", "#6d597a"),
    "hang": ("diamond-open", "#6d597a"),
}
REGIMES = [
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (2, "optimizer"),
    (3, "none"),
    (3, "optimizer"),
    (3, "optimizer+params"),
]


def _regime(params: dict[str, Any]) -> str:
    return f"ZeRO {params.get('zero_stage', 0)} / {params.get('offload', 'none')}"


def _predicted(paths: StudyPaths, row: TrialRow) -> float | None:
    outcome = read_outcome(TrialFiles(paths.trial_dir(row.number)).outcome)  # damaged: said once, unknown
    value = outcome.predicted_gib if outcome is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def _util_series(trial_dir: Path) -> dict[int, tuple[list[float], list[float]]]:
    """Per GPU: (seconds, utilization %) from the trial's gpu.csv; empty when there is none."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for tick in read_ticks(TrialFiles(trial_dir).gpu_csv):
        for reading in tick.gpus:
            if reading.util_pct is not None:
                xs, ys = series.setdefault(reading.gpu, ([], []))
                xs.append(tick.time_s)
                ys.append(reading.util_pct)
    return series


def _best_so_far(recipe: Recipe, launched: list[TrialRow]) -> Any:
    """Best exportable throughput so far, against launched trials and against GPU-hours spent."""
    import plotly.graph_objects as go

    limit = headroom_limit(recipe)
    best_so_far, hours, value, spent = [], [], 0.0, 0.0
    for r in launched:
        spent += (r.wall_time_s or 0.0) * recipe.gpus / 3600
        if (
            r.status == "ok"
            and not r.pruned
            and r.throughput
            and (limit is None or r.peak_memory_gib is None or r.peak_memory_gib <= limit)
        ):
            value = max(value, r.throughput)
        best_so_far.append(value)
        hours.append(spent)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=list(range(1, len(launched) + 1)),
            y=best_so_far,
            mode="lines+markers",
            name="by launched trial",
            line_shape="hv",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=hours, y=best_so_far, mode="lines+markers", name="by GPU-hours", xaxis="x2", line_shape="hv"
        )
    )
    fig.update_layout(
        title="Best exportable throughput so far",
        yaxis_title="completions/s",
        xaxis=dict(title="launched trials"),
        xaxis2=dict(title="GPU-hours spent", overlaying="x", side="top"),
    )
    return fig


def _throughput_memory(
    recipe: Recipe, all_rows: list[TrialRow], predicted: dict[int, float | None], best: TrialRow | None
) -> Any:
    """Throughput against peak memory, every outcome marked, with the capacity and headroom lines."""
    import plotly.graph_objects as go

    cap = (
        recipe.memory_limit_gib
        if recipe.device == "cpu" and recipe.memory_limit_gib
        else recipe.gpu_memory_gib
    )
    limit = headroom_limit(recipe)
    fig = go.Figure()
    for status, (symbol, color) in MARKERS.items():
        group = [
            r for r in all_rows if r.status == status and (r.launched or status in ("skipped", "invalid"))
        ]
        if not group:
            continue
        xs = [r.peak_memory_gib if r.peak_memory_gib is not None else predicted.get(r.number) for r in group]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[r.throughput or 0.0 for r in group],
                mode="markers",
                name=status,
                marker=dict(symbol=symbol, color=color, size=10),
                text=[f"trial {r.number}: {r.reason or r.error_line or ''}"[:160] for r in group],
                hoverinfo="text+x+y",
            )
        )
    if best is not None:
        fig.add_trace(
            go.Scatter(
                x=[best.peak_memory_gib],
                y=[best.throughput],
                mode="markers",
                name="exported",
                marker=dict(symbol="star", size=18, color="#ffb703", line=dict(width=1)),
            )
        )
    fig.add_vline(x=cap, line_dash="solid", annotation_text="capacity", annotation_position="top right")
    if limit is not None:
        fig.add_vline(
            x=limit,
            line_dash="dash",
            annotation_text=f"headroom {recipe.headroom:.0%}",
            annotation_position="top left",
        )
    fig.update_layout(
        title="Throughput against peak memory (OOM, skipped, invalid at 0; x is the predicted "
        "peak where none was measured)",
        xaxis_title="peak GiB per GPU",
        yaxis_title="completions/s",
    )
    return fig


def _oom_boundary(tried: list[TrialRow]) -> Any:
    """Where memory runs out: micro-batch against ZeRO stage and offload."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for status, (symbol, color) in MARKERS.items():
        group = [r for r in tried if r.status == status]
        if group:
            fig.add_trace(
                go.Scatter(
                    x=[r.params.get("per_device_train_batch_size") for r in group],
                    y=[_regime(r.params) for r in group],
                    mode="markers",
                    name=status,
                    marker=dict(symbol=symbol, color=color, size=11),
                    showlegend=True,
                )
            )
    fig.update_layout(
        title="Where memory runs out: micro-batch by ZeRO stage and offload",
        xaxis=dict(title="per_device_train_batch_size", type="log"),
        yaxis=dict(title="", categoryorder="array", categoryarray=[f"ZeRO {z} / {o}" for z, o in REGIMES]),
    )
    return fig


def _oom_boundary_vllm(tried: list[TrialRow]) -> Any | None:
    """Where memory runs out: micro-batch against the vLLM memory fraction; None without vLLM trials."""
    import plotly.graph_objects as go

    with_vllm = [r for r in tried if r.params.get("use_vllm") and r.params.get("vllm_gpu_memory_utilization")]
    if not with_vllm:
        return None
    fig = go.Figure()
    for status, (symbol, color) in MARKERS.items():
        group = [r for r in with_vllm if r.status == status]
        if group:
            fig.add_trace(
                go.Scatter(
                    x=[r.params.get("per_device_train_batch_size") for r in group],
                    y=[r.params.get("vllm_gpu_memory_utilization") for r in group],
                    mode="markers",
                    name=status,
                    marker=dict(symbol=symbol, color=color, size=11),
                )
            )
    fig.update_layout(
        title="Where memory runs out: micro-batch by vLLM memory fraction",
        xaxis=dict(title="per_device_train_batch_size", type="log"),
        yaxis=dict(title="vllm_gpu_memory_utilization"),
    )
    return fig


def _utilization(paths: StudyPaths, recipe: Recipe, launched: list[TrialRow], best: TrialRow | None) -> Any:
    """GPU utilization over time: the winner and up to four low-utilization trials."""
    import plotly.graph_objects as go

    watch = ([best] if best is not None else []) + [
        r for r in launched if r.diagnosis and (best is None or r.number != best.number)
    ][:4]
    fig = go.Figure()
    for r in watch:
        for gpu, (xs, ys) in sorted(_util_series(paths.trial_dir(r.number)).items()):
            label = "exported" if best is not None and r.number == best.number else "low utilization"
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"trial {r.number} ({label}) GPU {gpu}"))
    fig.add_hline(
        y=recipe.min_util * 100, line_dash="dash", annotation_text=f"--min-util {recipe.min_util:.0%}"
    )
    fig.update_layout(
        title="GPU utilization over time",
        xaxis_title="seconds since launch",
        yaxis=dict(title="utilization %", range=[0, 105]),
    )
    return fig


def _memory_model(launched: list[TrialRow], predicted: dict[int, float | None]) -> Any:
    """The memory model checked: each trial's prediction (made before it ran) against its measurement."""
    import plotly.graph_objects as go

    pairs = [
        (p, r.peak_memory_gib, r)
        for r in launched
        if r.peak_memory_gib is not None and (p := predicted.get(r.number)) is not None
    ]
    fig = go.Figure()
    if pairs:
        top = max(max(p, m) for p, m, _ in pairs) * 1.05
        fig.add_trace(
            go.Scatter(
                x=[0, top],
                y=[0, top],
                mode="lines",
                name="prediction = measurement",
                line=dict(dash="dot", color="#999"),
            )
        )
        for status in ("ok", "oom"):
            group = [(p, m, r) for p, m, r in pairs if r.status == status]
            if group:
                symbol, color = MARKERS[status]
                # an OOM's measured peak is where the GPU filled up: a lower bound of what it needed
                fig.add_trace(
                    go.Scatter(
                        x=[p for p, _, _ in group],
                        y=[m for _, m, _ in group],
                        mode="markers",
                        name="oom (measured until it failed)" if status == "oom" else status,
                        marker=dict(symbol=symbol, color=color, size=10),
                        text=[f"trial {r.number}" for _, _, r in group],
                    )
                )
    fig.update_layout(
        title="Memory model: predicted against measured peak (each predicted before its trial ran)",
        xaxis_title="predicted GiB per GPU",
        yaxis_title="measured GiB per GPU",
    )
    return fig


def _figures(
    paths: StudyPaths, recipe: Recipe, all_rows: list[TrialRow], best: TrialRow | None
) -> list[tuple[str, Any]]:
    """The report's figures in page order, each named for its section id."""
    launched = sorted((r for r in all_rows if r.launched), key=lambda r: r.number)
    predicted = {
        r.number: _predicted(paths, r) for r in all_rows if r.launched or r.status in ("skipped", "invalid")
    }
    tried = [r for r in all_rows if r.launched or r.status == "skipped"]
    figures: list[tuple[str, Any]] = [
        ("best-so-far", _best_so_far(recipe, launched)),
        ("throughput-memory", _throughput_memory(recipe, all_rows, predicted, best)),
        ("oom-boundary", _oom_boundary(tried)),
    ]
    vllm = _oom_boundary_vllm(tried)
    if vllm is not None:
        figures.append(("oom-boundary-vllm", vllm))
    figures.append(("utilization", _utilization(paths, recipe, launched, best)))
    figures.append(("memory-model", _memory_model(launched, predicted)))
    return figures


def report_html(study: optuna.Study, recipe: Recipe, paths: StudyPaths) -> str:
    """The whole report as one HTML document (plotly.js inlined)."""
    from plotly.offline import get_plotlyjs

    all_rows = rows(study)
    best, notes = choose_best(all_rows, recipe, confirmations(study), long_run_failures(study))
    launched = sum(1 for r in all_rows if r.launched)
    stopped = study.user_attrs.get("stopped")
    esc = html.escape
    parts = [
        f"<h1>autotune: {esc(recipe.model)} on {recipe.gpus} x {esc(recipe.gpu_type)}</h1>",
        f"<p>Study <code>{esc(paths.name)}</code>: {len(all_rows)} trials, {launched} launched. "
        + (esc(stopped) if stopped else "The search has not finished.")
        + "</p>",
    ]
    if best is not None:
        parts.append(f"<h2>Winner: trial {best.number}, {best.throughput:.4g} completions/s</h2>")
        parts.append(
            "<table><tr><th>parameter</th><th>value</th></tr>"
            + "".join(
                f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in best.params.items()
            )
            + "</table>"
        )
        if best.diagnosis:
            parts.append(f"<p class='diagnosis'>The winner left its GPUs idle: {esc(best.diagnosis)}</p>")
        parts.append("<h3>Why it won</h3><ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    else:
        parts.append("<h2>No configuration has run successfully yet.</h2>")
    low = sorted(
        (r for r in all_rows if r.diagnosis and r.status == "ok"), key=lambda r: -(r.throughput or 0)
    )
    if low:
        parts.append(
            f"<h3>Low GPU utilization (--min-util {recipe.min_util:.0%})</h3><ul class='low-util'>"
            + "".join(
                f"<li>trial {r.number} ({r.throughput or 0:.4g} completions/s): {esc(r.diagnosis or '')}</li>"
                for r in low
            )
            + "</ul>"
        )
    for name, fig in _figures(paths, recipe, all_rows, best):
        fig.update_layout(template="plotly_white", height=460, margin=dict(t=70, l=60, r=30, b=50))
        parts.append(
            f"<section id='{name}'>"
            + fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}")
            + "</section>"
        )
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        ".diagnosis{background:#fff3cd;padding:6px}section{margin:1.5em 0}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>autotune report: "
        f"{esc(paths.name)}</title><style>{style}</style><script>{get_plotlyjs()}</script></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )


#: During a search, report.html is rewritten at most this often (and always at its end): each
#: rewrite reads every trial and renders megabytes of HTML, which after every one of 120 quick
#: trials cost more time and controller memory than the trials' own bookkeeping.
REPORT_EVERY_S = 60.0
_written_at: dict[Path, float] = {}  # when this process last wrote each report (monotonic)


def write_report(
    study: optuna.Study,
    recipe: Recipe,
    paths: StudyPaths,
    out: Path | None = None,
    *,
    every_s: float = 0.0,
) -> Path | None:
    """Write report.html (atomically: a browser open on it never sees half a file).

    With ``every_s``, a report this process wrote less than ``every_s`` seconds ago is left as it
    is and None is returned: the search passes :data:`REPORT_EVERY_S` after each trial, and
    nothing (so always writes) at its end; ``autotune report`` always writes."""
    target = out or paths.root / REPORT_HTML
    last = _written_at.get(target)
    if every_s > 0 and last is not None and time.monotonic() - last < every_s:
        return None
    write_text(target, report_html(study, recipe, paths))
    _written_at[target] = time.monotonic()
    release_freed_memory()
    return target


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); False elsewhere.

    A report is built from every trial's files: megabytes of short-lived strings and plotly JSON.
    Between two rewrites the search keeps allocating small long-lived things (Optuna's trial cache,
    SQLite rows), which pin the heap above the freed space, and glibc only returns the heap's top.
    A 120-trial sim search held 29 MiB more free-but-resident heap every 35 trials this way (RSS
    168 -> 198 MiB; with no report it stayed at 143), while Python's own objects grew by 0.6 MiB."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (macOS, musl): nothing to call
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True

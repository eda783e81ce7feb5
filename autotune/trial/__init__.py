"""A trial runs and is judged: launch, monitor, parse, classify, telemetry.

Everything that happens to one candidate configuration once the search has chosen it lives here:
starting it as an isolated process group (:mod:`~autotune.trial.launch`), scanning and killing what
it left behind (:mod:`~autotune.trial.processes`, :mod:`~autotune.trial.cleanup`), sampling the GPUs
and the host while it runs (:mod:`~autotune.trial.telemetry`, :mod:`~autotune.trial.utilization`),
and reading its output into a verdict.
"""

"""``autotune run STUDY``: the production run, restarted from its newest checkpoint after an OOM.

One job per module: :mod:`checkpoints` finds the newest complete ``checkpoint-N`` (and never
touches one), :mod:`choice` picks the configuration a restart runs on, :mod:`launchers` turns a
configuration into the run's process (the study's runner, told to save and to resume), and
:mod:`supervisor` runs, watches, classifies and restarts it. Incidents are kept in the study
(:mod:`autotune.study.incidents`).
"""

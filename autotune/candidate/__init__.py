"""The candidate model: what one configuration is, whether it may run and what it would cost.

Pure functions of (model, recipe, candidate), below the runners, the export and the search that
all use them: the search space (``space``), its global batch (``batch``), the validity rules
(``constraints``), the memory model (``memory``) and the one call that applies it to a candidate
(``estimate``), the speed prior (``speed``) and the neighbours one or two knobs away (``moves``).
"""

"""What each CLI command does, one module per subcommand (the CLI only parses flags).

Each module checks its input, builds a result (a dataclass) and renders it, so that what a command
decides can be read and tested apart from how it is printed:

- :mod:`~autotune.commands.inputs`: the recipe's inputs resolved (model, hardware, space, pins);
  the trial context a study's runner needs
- :mod:`~autotune.commands.opening`: a study folder opened by name, a missing part named
- :mod:`~autotune.commands.search`: ``search`` and ``resume``, and the lines they end with
- :mod:`~autotune.commands.show`: the table (or JSON) of trials
- :mod:`~autotune.commands.export`: ``export`` and ``report``
- :mod:`~autotune.commands.estimate`: the memory model's breakdown of one candidate
- :mod:`~autotune.commands.verify`: best/params.json replayed as one longer trial

A study folder that lost a part (recipe.yaml, study.db) is named as such and refused before
anything is written, and a damaged database or a full disk met while a command runs ends it with
one line (:func:`autotune.study.checks.plain_failures`), never a traceback.
"""

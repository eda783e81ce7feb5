"""Export writes what people launch: ``best/`` with TRL, accelerate, DeepSpeed and ms-swift files.

One module per target (trl, accelerate, swift), the summary, and the writer that puts them in
place atomically.
"""

from autotune.export.writer import export_study, write_best

__all__ = ["export_study", "write_best"]

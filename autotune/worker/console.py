"""The worker's own lines on stdout."""

from __future__ import annotations

import os

__all__ = ["say"]


def say(message: str) -> None:
    """One line on stdout from the main process, prefixed so it is told apart from TRL's output.

    Called before the Trainer exists too, so the rank comes from the launcher's environment.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"autotune: {message}", flush=True)

"""Units and durations, defined once.

Memory figures are GiB everywhere in autotune (NVML, PyTorch's allocator messages, DeepSpeed's
estimators and vLLM all speak binary units), so the conversion factors live here and nowhere else.
"""

from __future__ import annotations

import re
from typing import Any

GIB = 2**30
MIB = 2**20
KIB = 2**10
MIB_PER_GIB = GIB // MIB  # NVML reports MiB; autotune speaks GiB

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: Any) -> float | None:
    """'8h', '90m', '1h30m', '2m 23s', '45s', '1.5d' or plain seconds -> seconds; None if unreadable.

    One reader for the user's ``--time-budget`` and for ms-swift's ``elapsed_time`` log field.
    """
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    lowered = str(text).strip().lower()
    parts = _DURATION_PART.findall(lowered)
    if not parts or _DURATION_PART.sub("", lowered).strip():
        return None
    return sum(float(number) * _SECONDS[unit] for number, unit in parts)

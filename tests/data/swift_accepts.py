"""Which ``swift rlhf`` command lines ms-swift accepts at start, asked of ms-swift itself.

Run by the python of ms-swift's own environment (tests/test_swift_arguments.py): reads a JSON list of
argument lists (what follows ``swift rlhf``) on stdin and prints, for each, one JSON line: whether
ms-swift's real argument classes took it (``RLHFArguments`` and its ``__post_init__``, which builds
the GRPO training arguments, as ``swift rlhf`` does before it loads anything), the error they raised
otherwise, and the values ms-swift settled on (it silently changes some, e.g. ``sleep_level``).
"""

import contextlib
import io
import json
import sys

from swift.arguments import RLHFArguments
from swift.utils import parse_args


def judge(argv: list[str]) -> dict:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, rest = parse_args(RLHFArguments, argv)
        if rest:  # what SwiftPipeline._parse_args refuses
            return {"ok": False, "error": f"remaining_argv: {rest}"}
    except (Exception, SystemExit) as exc:  # argparse exits on a bad value; the checks raise or assert
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    train = args.training_args
    return {
        "ok": True,
        "sleep_level": args.sleep_level,
        "generation_batch_size": getattr(train, "generation_batch_size", None),
        "steps_per_generation": getattr(train, "steps_per_generation", None),
    }


for argv in json.load(sys.stdin):
    print(json.dumps(judge(argv)), flush=True)

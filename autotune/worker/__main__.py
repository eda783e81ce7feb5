"""``python -m autotune.worker`` (also what ``accelerate launch -m autotune.worker`` runs per process)."""

import sys

from autotune.worker.trial import main

if __name__ == "__main__":
    sys.exit(main())

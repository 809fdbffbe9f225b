"""``specbatch train-decision`` / ``python -m jobs.train_decision``: Lu et al.'s early-stop decision model.

    specbatch train-decision --draft D --data PATH [--target T] [--output DIR] [--field VALUE ...]

Same collection as train-head; the model ``length_policy: decision`` loads from ``speculative.decision_model``
(default output ``<draft>/decision_model``). ``--keep_cutoff P`` sets the acceptance probability below which
drafting stops (see training/signals.py).
"""

from __future__ import annotations

import sys

from jobs.train_head import signal_main


def main(argv: list[str] | None = None) -> int:
    return signal_main(argv, "decision_model", "specbatch train-decision")


if __name__ == "__main__":
    sys.exit(main())

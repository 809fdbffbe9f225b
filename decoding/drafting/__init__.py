"""Drafting: the drafter interface and its registry (``drafters.py``), one file per drafter (``lookup.py``,
``recycle.py``, ``draft_model.py``; the feature draft's model in ``feature_draft.py``, layer skipping in
``layer_skip.py``), the length policies that decide how deep to draft (``length_policies.py``, with the small MLP
of ``signal_head.py``) and the measured forward costs the online policy prices steps with (``costs.py``).

The built-in drafters register themselves when this package loads.
"""

from decoding.drafting import draft_model, lookup, recycle  # noqa: F401  (registration)

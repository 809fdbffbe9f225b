"""Drafting: the drafters that propose candidate trees (``drafters.py``, the feature draft in ``feature_draft.py``),
the length policies that decide how deep to draft (``length_policies.py``, with the small MLP of
``signal_head.py``) and the measured forward costs the online policy prices steps with (``costs.py``)."""

"""Verification: the candidate tree's topology (``tree.py``), the acceptance rule as a readable oracle
(``acceptance.py``), the same rule for a whole batch on the device (``verify_batched.py``), and the logit
processing target and draft share (``sampling.py``)."""

"""Structured outputs: grammars compiled through xgrammar (``grammar.py``) and their masks at every node of the
candidate tree in the step (``constrained.py``)."""

"""Thin entrypoints: ``specbatch <command>`` and ``python -m jobs.<command>`` (for ``ray job submit``)."""

"""Benchmarks of the engine against plain decoding and transformers (``specbatch bench``); not part of the engine."""

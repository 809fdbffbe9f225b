"""The model's forward: loading (``loading.py``), the lean Llama-family forward (``lean_forward.py``) and its
attention over the paged KV cache (``kv_cache.py``: the block pool, its tables, prefix caching; ``attention.py``, the
C++ CPU kernel in ``csrc/``; rows padded to static shapes by ``padding.py``), weight-only quantization
(``quantize.py``), the CPU's ahead-of-time compiled layer stack (``compiled_forward.py``), CUDA graphs
(``cuda_graphs.py``), and the one call every target and draft forward goes through (``forward.py``)."""

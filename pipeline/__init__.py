"""specbatch's Ray Data pipeline: prompt files -> engine actors -> Parquet outputs and token statistics.

Entry point: ``pipeline.job.run`` (``specbatch generate``); ``pipeline.job.generate`` for a Dataset of one's own.
"""

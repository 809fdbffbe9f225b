"""specbatch's Ray Data pipeline: prompt files -> engine actors -> Parquet outputs and token statistics."""

from pipeline.job import generate, run

__all__ = ["generate", "run"]

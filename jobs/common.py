"""Argument handling shared by the entrypoints: ``--config FILE`` plus dotted overrides of any field."""

from __future__ import annotations

import argparse
import logging
import sys

from decoding.config import Config, ConfigError, load_config


def split_overrides(unknown: list[str]) -> dict[str, str]:
    """``--speculative.num_candidates 3`` / ``--sampling.temperature=0.7`` -> {dotted key: raw value}."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(unknown):
        arg = unknown[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (overrides look like --section.field VALUE)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(unknown) or unknown[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} needs a value")
            value = unknown[i + 1]
            i += 1
        overrides[key] = value
        i += 1
    return overrides


def parse_with_config(
    parser: argparse.ArgumentParser, argv: list[str], defaults: dict[str, str] | None = None
) -> tuple[argparse.Namespace, Config]:
    """Parse known options; every other ``--a.b VALUE`` overrides a config field (over ``defaults``, a job's own
    dotted defaults). Exits 2 on a bad config."""
    parser.add_argument("--config", help="YAML config file (fields: docs/reference.md)")
    args, unknown = parser.parse_known_args(argv)
    try:
        config = load_config(args.config, {**(defaults or {}), **split_overrides(unknown)})
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return args, config


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

"""Logging setup for the CLI commands (loguru).

With `--json-output` every line on stdout is a loguru JSON record (`{"text": ..., "record": {...}}`),
which is what TGI's launcher parses; it shows other stdout lines only at debug level.
"""

from __future__ import annotations

import sys

from loguru import logger

# TGI's launcher passes tracing level names; loguru spells one of them differently.
_LEVEL_ALIASES = {"WARN": "WARNING"}
LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "WARN", "ERROR", "CRITICAL")
PLAIN_FORMAT = "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <8}</level> | {name}:{line} - {message}"


def setup_logging(level: str = "INFO", json_output: bool = False) -> None:
    name = level.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"--logger-level {level!r} is not known; choose one of {', '.join(LEVELS)}")
    name = _LEVEL_ALIASES.get(name, name)
    logger.remove()
    # diagnose=False: tracebacks must not print local variables (request text, image bytes).
    if json_output:
        logger.add(sys.stdout, serialize=True, level=name, backtrace=True, diagnose=False)
    else:
        logger.add(sys.stderr, format=PLAIN_FORMAT, level=name, backtrace=True, diagnose=False)

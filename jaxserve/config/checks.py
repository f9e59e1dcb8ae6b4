"""Validation shared by the config dataclasses."""

from __future__ import annotations


def check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    """Check a config field is a positive int (or None with ``allow_none``).

    Raises:
      ValueError: it is not (names the field and the value).
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

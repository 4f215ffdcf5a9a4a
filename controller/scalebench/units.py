"""Byte sizes as the CLI and experiment files write them ("32k", "1G", "896K")."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_SUFFIX = {
    "": 1,
    "b": 1,
    "k": KIB,
    "kb": KIB,
    "kib": KIB,
    "m": MIB,
    "mb": MIB,
    "mib": MIB,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": 1024 * GIB,
    "tb": 1024 * GIB,
    "tib": 1024 * GIB,
}


def parse_size(text: str | int) -> int:
    """Parse "32k" / "1G" / "896K" / 4096 into bytes (binary multiples, as densevm does)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower()
    i = len(s)
    while i > 0 and not s[i - 1].isdigit():
        i -= 1
    number, suffix = s[:i], s[i:].strip()
    if not number or suffix not in _SUFFIX:
        raise ValueError(f"not a size: {text!r} (examples: 32k, 896K, 1G)")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 32k, 896K, 1G)") from None
    return int(value * _SUFFIX[suffix])


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

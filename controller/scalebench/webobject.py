"""The objects webguest serves, byte for byte (guest-images/webguest/README.md).

Byte i of either object is PATTERN[i % 4096], where
PATTERN[k] = ALPHABET[(k + k // 64) % 64] and ALPHABET is A-Z, a-z, 0-9, '+', '/'.
"""

from __future__ import annotations

import string

SMALL_BYTES = 2258
LARGE_BYTES = 134_007
PERIOD = 4096
ALPHABET = string.ascii_uppercase + string.ascii_lowercase + string.digits + "+/"
PATTERN = "".join(ALPHABET[(k + k // 64) % 64] for k in range(PERIOD)).encode()


def object_bytes(size: int) -> bytes:
    """The first `size` bytes of the object pattern."""
    return (PATTERN * (size // PERIOD + 1))[:size]


SMALL = object_bytes(SMALL_BYTES)
LARGE = object_bytes(LARGE_BYTES)

"""The one error type of the database-guest layer: its message is shown to users as is."""

from __future__ import annotations


class DbTraceError(RuntimeError):
    """A failure with a clear one-line explanation (libvirt, image, guest, tracer, workload)."""

"""The root of mixplane's own exceptions.

Every error mixplane raises on purpose -- a spec, a wire message, a Parquet file, a journal, a partition handoff,
a delivery, the operator's API calls -- is a :class:`MixplaneError`, and keeps the built-in kind it always had
(``SpecError`` is still a ``ValueError``, ``DeliveryError`` a ``RuntimeError``, ``RemoteError`` an ``OSError``), so
``except MixplaneError`` catches what mixplane says about the data plane and nothing else, and existing handlers
keep working. Imports nothing.
"""

from __future__ import annotations


class MixplaneError(Exception):
    """An error mixplane raises on purpose; its text names the file, field, step or peer it is about."""

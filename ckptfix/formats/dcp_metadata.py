"""Moved to :mod:`ckptfix.dcp_metadata`: a pickle policy sits below both the scanner and this reader.
Re-exported here for code that imports it from its old place."""

from __future__ import annotations

from ..dcp_metadata import METADATA, load_metadata, metadata_names, metadata_policy, read_bytes, record_ranges

__all__ = ["METADATA", "load_metadata", "metadata_names", "metadata_policy", "read_bytes", "record_ranges"]

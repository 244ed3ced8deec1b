"""The library's operations on checkpoints: read, load, inspect, describe, load_into and convert (``api``,
with ``reading`` and the conversion steps in ``convert``), and diff.

May import: every layer below (core, parse, safety, statedict, formats) and the top-level ``errors``,
``reports`` and ``text``.
"""

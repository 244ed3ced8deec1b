"""The library's operations on checkpoints, one package per verb: ``read`` (a checkpoint, file or URL, read into
a Checkpoint: read, inspect, describe, and every verb's first step), ``convert`` and ``load_into``; ``api``
defines the public verbs over them, ``diff`` is one module; ``convert_options`` and ``sources`` are shared.

May import: every layer below (core, parse, safety, statedict, formats) and the top-level ``errors``,
``reports`` and ``text``.
"""

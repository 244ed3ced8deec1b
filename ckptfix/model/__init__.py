"""Verification against a model: the model spec (``spec``), forward inputs (``inputs``), forward equivalence
(``forward``), golden outputs (``golden``), the serving loader's view of a file (``serving``) and ``verify``, the
pre-deploy gate.

May import: every layer below, :mod:`ckptfix.ops` included.
"""

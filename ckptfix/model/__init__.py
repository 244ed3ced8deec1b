"""Verification against a model: the model spec (``spec``), forward inputs (``inputs``), forward equivalence
(``forward``), golden outputs (``golden``) and ``verify``, the pre-deploy gate.

May import: every layer below, :mod:`ckptfix.ops` included.
"""

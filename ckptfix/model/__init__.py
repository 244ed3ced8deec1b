"""Verification against a model: the model spec (``spec``), forward inputs (``inputs``), forward equivalence
(``forward``), golden outputs (``golden``), the serving loader's view of a file (``serving``) and ``verify``, the
pre-deploy gate: its options declared once (``verify_options``), its checks a list (``checks``), what they find
(``findings``) and the fix they suggest (``fixes``).

May import: every layer below, :mod:`ckptfix.ops` included.
"""

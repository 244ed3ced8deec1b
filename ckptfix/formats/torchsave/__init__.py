"""The files ``torch.save`` writes: the zip format (torch >= 1.6) and the legacy pickle stream. Read through
torch's own loader with ckptfix's restricted unpickler (``torch_io``), or record by record without loading
tensor data (``records``); written by ``torch.save`` or by copying records (``records``, ``zipwriter``), with
torch's globals stood in by ``torch_globals`` where torch isn't imported.

May import: the layers below :mod:`ckptfix.formats` and the ``formats`` package itself.
"""

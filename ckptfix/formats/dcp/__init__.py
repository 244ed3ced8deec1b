"""torch.distributed.checkpoint directories (``.metadata`` plus ``__R_S.distcp`` files): the directory
(``directory``), its chunks located, checked and copied (``chunks``), and Lightning's sharded directories,
DCP files plus ``meta.pt`` (``lightning``).

May import: the layers below :mod:`ckptfix.formats` and the ``formats`` package itself.
"""

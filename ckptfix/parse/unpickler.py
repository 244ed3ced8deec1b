"""ckptfix's own restricted unpickler: the one that executes untrusted pickles, with its policy built in.

torch's ``weights_only`` unpickler builds only allow-listed globals, but some of those are unsafe to
*call* with arbitrary arguments: ``torch.ByteTensor(n)`` and ``torch.UntypedStorage(n)`` hand out
uninitialised memory, ``bytearray(2_500_000_000)`` allocates gigabytes from a 1 KB pickle, a view
``_rebuild_tensor_v2(storage, 0, (10**9,), (1,))`` past its storage makes torch *resize* the storage
(uninitialised bytes again, or another record's bytes on ``meta``), and BUILD on a numpy dtype can
declare object fields whose pointers come from the file. This unpickler runs the same opcodes with
a stricter policy (:mod:`ckptfix.safety.allowlist` names the globals, :mod:`ckptfix.safety.guards` decides what
each may do; :mod:`ckptfix.parse.pickle_ops` has the opcodes):

- a global resolves only if the policy lists it; dotted names and copyreg extensions never do;
- calling (REDUCE, NEWOBJ, OBJ, INST) goes through a guard per callable, which checks the arguments
  (tensor views inside their storage, sizes within the limits) before the real call;
- BUILD only on instances of types the policy names, never on a class or function;
- containers are hashed only when their nesting is within ``max_depth``, and the finished object is
  checked against ``max_depth``; calls and BUILDs may copy at most ``max_alloc_bytes`` beyond the
  pickle's own size (:mod:`ckptfix.core.limits`).

``torch.load(f, pickle_module=SafePickle(policy), weights_only=False)`` makes torch use it for every
pickle it reads (zip, legacy, tar); ``ckptfix.formats.torchsave.torch_io.torch_load`` wraps exactly that.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

from ..core import limits as _limits
from ..core.units import shown
from ..errors import LimitError
from . import inert as _inert
from .pickle_ops import DISPATCH, Refused, stop, type_name


class Policy:
    """What one kind of pickle may contain. Built by :mod:`ckptfix.safety.guards` (and DCP's metadata reader).

    ``globals``: name → object; ``calls``: id(object) → guard ``(unpickler, obj, args, kwargs)``;
    ``newobj``: ids of classes NEWOBJ may instantiate with ``cls.__new__(cls, *args)``;
    ``build``: type → handler ``(unpickler, inst, state)``; ``append``/``setitem``: container types
    APPEND / SETITEM may fill; ``persistent``: whether persistent ids (torch storages) may appear;
    ``finish``: called with the loaded object (turns stand-ins into the real thing);
    ``inert``: given the name of a global the table lacks, an :class:`~ckptfix.parse.inert.InertGlobal`
    for it (or Refused): calls and BUILDs of it then make :class:`~ckptfix.parse.inert.InertObject`
    placeholders, nothing imported or called; None: such a global is refused.
    """

    def __init__(self, globals_: dict[str, Any], calls: dict[int, Callable], newobj: set[int],
                 build: dict[type, Callable], append: tuple[type, ...], setitem: tuple[type, ...],
                 persistent: bool = True, finish: Callable[[Any], Any] | None = None,
                 inert: Callable[[str], Any] | None = None):
        self.globals = globals_
        self.calls = calls
        self.newobj = newobj
        self.build = build
        self.append = append
        self.setitem = setitem
        self.persistent = persistent
        self.finish = finish or (lambda obj: obj)
        self.inert = inert
        if inert is not None:  # placeholders take state and items as data, recorded, never applied
            self.build = {**build, _inert.InertObject: _inert.build}
            self.append = (*append, _inert.InertObject)
            self.setitem = (*setitem, _inert.InertObject)


class Unpickler:
    """A pickle virtual machine with the checks of :class:`Policy`; the interface torch.load uses:
    ``Unpickler(file, *, encoding=...)``, ``.find_class``, ``.persistent_load``, ``.load()``."""

    policy: Policy  # set by SafePickle on its subclass
    default_where = "pickle"  # the file, for messages (SafePickle sets it)

    def __init__(self, file: Any, *, encoding: str = "ASCII", errors: str = "strict", fix_imports: bool = True,
                 **_ignored: Any):
        self.read = file.read
        self.readline = file.readline
        self.file = file
        self.encoding, self.errors = encoding, errors
        self.memo: dict[int, Any] = {}
        self.limits = _limits.current()
        name = getattr(file, "name", None)
        self.where = name if isinstance(name, str) else self.default_where
        self.allocated = 0
        self.proto = 0
        self.storages: dict[str, Any] = {}

    # -- what torch.load overrides ---------------------------------------------------------------
    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if self.policy.inert is not None and full not in self.policy.globals:
            return self.policy.inert(full)  # a name only: never looked up
        if "." in name or not module or full not in self.policy.globals:
            raise Refused(f"Unsupported global: GLOBAL {shown(full)} is not on ckptfix's safe allow-list", full)
        return self.policy.globals[full]

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("persistent ids are not allowed in this pickle")

    # -- checks the guards use ------------------------------------------------------------------
    def charge(self, amount: int, what: str) -> None:
        """Count ``amount`` elements/bytes created by a call; refuse past the pickle size + max_alloc_bytes."""
        self.allocated += max(0, int(amount))
        budget = self.limits.max_alloc_bytes + self._size_hint()
        if self.allocated > budget:
            raise _limits.exceeded("max_alloc_bytes", f"what the pickle's calls create ({what})", self.allocated,
                                   self.where)

    def _size_hint(self) -> int:
        if not hasattr(self, "_size"):
            self._size = _stream_size(self.file)
        return self._size

    def hashable(self, key: Any) -> Any:
        """``key`` if it can be hashed without recursing past max_depth (deep tuples crash ``hash``)."""
        if type(key) in (str, int, bytes, float, bool) or key is None:
            return key
        stack, depth_of = [(key, 1)], self.limits.max_depth
        while stack:
            x, depth = stack.pop()
            if depth > depth_of:
                raise _limits.exceeded("max_depth", "a dict key or set member nests deeper than allowed", where=self.where)
            if isinstance(x, (tuple, frozenset)):
                stack.extend((v, depth + 1) for v in x)
        return key

    # -- the machine --------------------------------------------------------------------------------
    def load(self) -> Any:
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        dispatch = DISPATCH
        read = self.read
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("the pickle ends before STOP")
                handler = dispatch.get(key[0])
                if handler is None:
                    raise pickle.UnpicklingError(f"invalid load key, {key!r}")
                if handler is stop:
                    value = self.pop()
                    check_depth(value, self.limits.max_depth, self.where)
                    return value
                handler(self)
        except RecursionError:
            raise _limits.exceeded("max_depth", "the pickle nests deeper than allowed", where=self.where) from None

    def pop(self) -> Any:
        if not self.stack:
            raise pickle.UnpicklingError("unpickling stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise pickle.UnpicklingError("unpickling stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise pickle.UnpicklingError("MARK not found")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def read_exact(self, n: int) -> bytes:
        if n > 1 << 20 and n > self._remaining():
            raise pickle.UnpicklingError(f"a {n}-byte value runs past the end of the pickle")
        data = self.read(n)
        if len(data) != n:
            raise pickle.UnpicklingError("pickle data was truncated")
        return data

    def _remaining(self) -> int:
        try:
            return self._size_hint() - self.file.tell()
        except (OSError, AttributeError, ValueError):
            return 1 << 62

    def readline_(self) -> bytes:
        line = self.readline()
        if not line.endswith(b"\n"):
            raise pickle.UnpicklingError("pickle data was truncated")
        return line

    def call(self, func: Any, args: Any, kwargs: Any, op: str) -> Any:
        if not isinstance(args, tuple) or kwargs is not None and not isinstance(kwargs, dict):
            raise pickle.UnpicklingError(f"{op}: arguments must be a tuple")
        if isinstance(func, _inert.InertGlobal):
            self.charge(len(args), f"{op} of {shown(func.name)}")
            return _inert.call(func, args, op)  # recorded, never called
        guard = self.policy.calls.get(id(func))
        if guard is None:
            raise Refused(f"{op} calls {type_name(func)}, which ckptfix never calls on untrusted data "
                          "(it could allocate uninitialised memory or run code)", type_name(func))
        return guard(self, func, args, kwargs or {})

    @staticmethod
    def is_placeholder(obj: Any) -> bool:
        """An inert global (:mod:`ckptfix.parse.inert`): calling or instantiating it makes a placeholder."""
        return isinstance(obj, _inert.InertGlobal)

    def decode_string(self, value: bytes) -> Any:
        if self.encoding == "bytes":
            return value
        return value.decode(self.encoding, self.errors)


def _stream_size(f: Any) -> int:
    try:
        if isinstance(f, io.BytesIO):
            return len(f.getbuffer())
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        length = getattr(f, "length", None)
        return length if isinstance(length, int) else 1 << 30


def check_depth(obj: Any, limit: int, where: str = "pickle") -> None:
    """Refuse ``obj`` when containers (tuples, lists, dicts, sets, object attributes) nest past ``limit``.

    Iterative, so a hostile depth can't exhaust the stack here; shared objects are visited once.
    """
    seen: set[int] = set()
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if type(x) in (str, int, float, bool, bytes) or x is None:
            continue
        if depth > limit:
            raise _limits.exceeded("max_depth", "the pickle nests containers deeper than allowed", where=where)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            items: Any = [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = x
        else:
            state = getattr(x, "__dict__", None)
            items = list(state.values()) if type(state) is dict else ()
        stack.extend((v, depth + 1) for v in items)


# -- BUILD handlers shared by the policies ------------------------------------------------------------

def build_attributes(u: Unpickler, inst: Any, state: Any) -> None:
    """pickle's default BUILD: a dict of attributes (and, for slots, a second one), str keys only; a slot state
    that sets a dunder (``__class__``: the object's type) is refused."""
    slotstate = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slotstate = state
    for part in (state, slotstate):
        if part is None:
            continue
        if type(part) is not dict or not all(type(k) is str for k in part):
            raise Refused(f"BUILD of a {type_name(inst)}: state must be a dict of attribute names")
        u.charge(len(part), "BUILD")
    dunder = next((k for k in slotstate or () if is_dunder(k)), None)
    if dunder is not None:  # setattr(obj, "__class__", cls) swaps the object's type: never applied
        raise Refused(f"BUILD of a {type_name(inst)} sets its attribute {shown(dunder)}, which no checkpoint sets")
    if state:
        inst.__dict__.update(state)
    for k, v in (slotstate or {}).items():
        setattr(inst, k, v)


def is_dunder(name: str) -> bool:
    """``__class__``, ``__dict__``: a name pickle's BUILD would ``setattr`` on the object's machinery itself."""
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def build_setstate(u: Unpickler, inst: Any, state: Any) -> None:
    """BUILD through the type's own ``__setstate__`` (types whose ``__setstate__`` validates)."""
    u.charge(len(state) if isinstance(state, (dict, tuple, list)) else 1, "BUILD")
    inst.__setstate__(state)


class SafePickle:
    """A pickle module for ``torch.load(pickle_module=...)``: its Unpickler is :class:`Unpickler`
    with ``policy``; ``load`` is what torch calls for the small pickles of a legacy file."""

    def __init__(self, policy: Policy, where: str = "pickle"):
        self.__name__ = "ckptfix.parse.unpickler"
        self.Unpickler = type("Unpickler", (Unpickler,), {"policy": policy, "default_where": where})

    def load(self, file: Any, **kwargs: Any) -> Any:
        unpickler = self.Unpickler(file, **kwargs)
        return unpickler.load()


def loads(data: bytes, policy: Policy, encoding: str = "utf-8", persistent_load: Callable | None = None,
          where: str = "pickle") -> Any:
    """Unpickle ``data`` under ``policy`` (finish applied). Raises Refused / LimitError / UnpicklingError."""
    if len(data) > _limits.current().max_pickle_bytes:
        raise _limits.exceeded("max_pickle_bytes", "the pickle's size", len(data), where)
    module = SafePickle(policy)
    unpickler = module.Unpickler(io.BytesIO(data), encoding=encoding)
    unpickler.where = where
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load
    return policy.finish(unpickler.load())


__all__ = ["Unpickler", "SafePickle", "Policy", "Refused", "LimitError", "loads", "check_depth", "is_dunder",
           "build_attributes", "build_setstate", "type_name"]

"""Static pickle analysis: walk the opcodes with a simulated stack and memo, executing nothing.

Every global a pickle can reach is recorded: GLOBAL and INST name it inline, STACK_GLOBAL takes
its two strings from the stack (often fed from the memo to hide them), and REDUCE, NEWOBJ, OBJ and
INST call what is on the stack. Nothing is imported or called: values are plain containers,
``Ref`` for a global, ``Call`` for what calling one would produce and ``Persistent`` for a
persistent id (a torch storage).

>>> walk(b"\\x80\\x02cposix\\nsystem\\nX\\x02\\x00\\x00\\x00ls\\x85R.").uses[0].full  # doctest: +SKIP
'posix.system'
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core import limits as _limits
from ..errors import LimitError
from . import pickle_args as args_of
from ..core.units import shown
from .pickle_ops import decode_name as resolve_name
from .unpickler import check_depth

# pickletools and the simulation raise these on a malformed or truncated stream.
_PARSE_ERRORS = (pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError, EOFError, OverflowError, struct.error,
                 RecursionError)


@dataclass(eq=False)
class Ref:
    """A global named by the pickle (never looked up)."""

    module: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(eq=False)
class Call:
    """What calling ``func`` with ``args`` would have produced; BUILD state and items kept."""

    func: Any
    args: Any = ()
    state: Any = None
    items: list[Any] = field(default_factory=list)
    op: str = "REDUCE"
    built: bool = False  # a BUILD gave it state


@dataclass(eq=False)
class Persistent:
    """A persistent id (torch: ``('storage', StorageType, key, location, numel)``)."""

    pid: Any


@dataclass
class Use:
    """One place a global is referenced (``GLOBAL``, ``STACK_GLOBAL``, ``INST``) or called."""

    module: str
    name: str
    op: str
    pos: int

    @property
    def full(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Walk:
    """The result of walking one pickle: what it references and, if it parsed, its simulated value."""

    where: str
    start: int
    end: int | None = None  # offset just past STOP; None when the pickle is malformed
    protocol: int = 0
    uses: list[Use] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unsafe constructs other than a named global
    error: str | None = None  # why the walk stopped before STOP
    value: Any = None
    persistent_ids: list[Any] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # every call of a named global, with its arguments


class _Malformed(Exception):
    pass


def walk(buf: Any, start: int = 0, where: str = "pickle") -> Walk:
    """Walk the pickle starting at ``buf[start]`` (bytes or mmap) up to its STOP.

    Never raises for bad input: a malformed stream sets ``error`` and keeps everything seen
    before the break, since an unpickler runs those opcodes before it fails.
    """
    result = Walk(where=where, start=start)
    stream = buf if hasattr(buf, "readline") else io.BytesIO(buf)
    stream.seek(start)
    machine = _Machine(result)
    pos = start
    try:
        while True:
            pos = stream.tell()
            name, arg = _read_op(stream)
            machine.step(name, arg, pos)
            if name == "STOP":
                result.end = stream.tell()
                _check_depth(result)
                return result
    except (_Malformed, *_PARSE_ERRORS) as e:
        result.error = f"at byte {pos}: {str(e) or type(e).__name__}"
    return result


def _read_op(stream: Any) -> tuple[str, Any]:
    """The next opcode's name and argument; text arguments as CPython's C unpickler reads them
    (:mod:`ckptfix.parse.pickle_args`), strings decoded as torch.load decodes them (UTF-8)."""
    code = stream.read(1)
    if not code:
        raise _Malformed("the stream ends before STOP")
    opcode = _OPCODES.get(code.decode("latin-1"))
    if opcode is None:
        raise _Malformed(f"invalid opcode {code!r}")
    if opcode.name in _TEXT_ARGS:
        return opcode.name, _TEXT_ARGS[opcode.name](stream)
    if opcode.arg is None:
        return opcode.name, None
    arg = opcode.arg.reader(stream)
    if opcode.name in ("BINSTRING", "SHORT_BINSTRING"):  # pickletools decodes these as latin-1
        arg = arg.encode("latin-1").decode("utf-8")
    return opcode.name, arg


_OPCODES = {op.code: op for op in pickletools.opcodes}


def _name_pair(encoding: str) -> Callable[[Any], tuple[str, str]]:
    return lambda f: (args_of.name_arg(f.readline(), encoding), args_of.name_arg(f.readline(), encoding))


_TEXT_ARGS: dict[str, Callable[[Any], Any]] = {
    "INT": lambda f: args_of.int_arg(f.readline()),
    "LONG": lambda f: args_of.long_arg(f.readline()),
    "FLOAT": lambda f: args_of.float_arg(f.readline()),
    "STRING": lambda f: args_of.string_arg(f.readline()).decode("utf-8"),
    "UNICODE": lambda f: args_of.unicode_arg(f.readline()),
    "GET": lambda f: args_of.memo_arg(f.readline()),
    "PUT": lambda f: args_of.memo_arg(f.readline()),
    "PERSID": lambda f: args_of.persid_arg(f.readline()),
    "GLOBAL": _name_pair("utf-8"),
    "INST": _name_pair("ascii"),
}


def _check_depth(result: Walk) -> None:
    """A value nested past the limit max_depth: the loader refuses it, so the scan reports it."""
    try:
        check_depth(result.value, _limits.current().max_depth, result.where)
    except LimitError as e:
        result.problems.append(str(e))


def walk_stack(buf: Any, start: int, end: int, where: str) -> list[Walk]:
    """Walk consecutive pickles in ``buf[start:end]`` until the end or the first malformed one."""
    walks: list[Walk] = []
    pos = start
    while pos < end:
        label = where if not walks else f"{where}, pickle {len(walks) + 1} at byte {pos}"
        w = walk(buf, pos, label)
        walks.append(w)
        if w.end is None:
            break
        pos = w.end
    return walks


class _Machine:
    """The unpickler's stack machine, over inert values."""

    def __init__(self, result: Walk):
        self.r = result
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.handlers = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}

    # -- helpers -------------------------------------------------------------------------------
    def push(self, value: Any) -> None:
        self.stack.append(value)

    def pop(self) -> Any:
        if not self.stack:
            raise _Malformed("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise _Malformed("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise _Malformed("no MARK to pop to")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def ref(self, module: str, name: str, op: str, pos: int) -> Ref:
        module, name = resolve_name(module, name)
        ref = Ref(module, name)
        self.r.uses.append(Use(module, name, op, pos))
        return ref

    def call(self, func: Any, args: Any, op: str, pos: int) -> None:
        call = Call(func, args, op=op)
        if isinstance(func, Ref):
            self.r.uses.append(Use(func.module, func.name, op, pos))
            self.r.calls.append(call)
        else:
            self.r.problems.append(f"{op} at byte {pos} calls a computed object, not a named global")
        self.push(call)

    def mutate(self, target: Any, op: str, pos: int) -> None:
        if isinstance(target, Ref):
            self.r.problems.append(f"{op} at byte {pos} modifies the global {shown(target.full)} itself")

    # -- the opcodes ---------------------------------------------------------------------------
    def step(self, op: str, arg: Any, pos: int) -> None:
        handler = self.handlers.get(op)
        if handler is not None:
            handler(arg, pos)
        elif op in _CONSTANTS:
            self.stack.append(arg)
        elif op in _NEW:
            self.push(_NEW[op]())
        elif op not in ("FRAME", "READONLY_BUFFER"):
            raise _Malformed(f"unhandled opcode {op}")  # pragma: no cover - every opcode is listed

    def op_PROTO(self, arg: int, pos: int) -> None:
        self.r.protocol = arg

    def op_MARK(self, arg: Any, pos: int) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def op_TUPLE(self, arg: Any, pos: int) -> None:
        self.push(tuple(self.pop_mark()))

    def op_TUPLE1(self, arg: Any, pos: int) -> None:
        self.push((self.pop(),))

    def op_TUPLE2(self, arg: Any, pos: int) -> None:
        b, a = self.pop(), self.pop()
        self.push((a, b))

    def op_TUPLE3(self, arg: Any, pos: int) -> None:
        c, b, a = self.pop(), self.pop(), self.pop()
        self.push((a, b, c))

    def op_LIST(self, arg: Any, pos: int) -> None:
        self.push(self.pop_mark())

    def op_DICT(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        d: dict[Any, Any] = {}
        self._deep_keys(items[::2], "DICT", pos)
        _set_items(d, items)
        self.push(d)

    def _deep_keys(self, keys: list[Any], op: str, pos: int) -> None:
        if any(type(k) not in (str, int) and _too_deep(k) for k in keys):
            self.r.problems.append(f"{op} at byte {pos}: a dict key or set member nests deeper than the limit "
                                   f"max_depth = {_limits.current().max_depth:,} (hashing it would exhaust the C stack)")

    def op_FROZENSET(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        self._deep_keys(items, "FROZENSET", pos)
        self.push(frozenset(i for i in items if _hashable(i)))

    def op_APPEND(self, arg: Any, pos: int) -> None:
        value = self.pop()
        self._extend(self.top(), [value], "APPEND", pos)

    def op_APPENDS(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        self._extend(self.top(), items, "APPENDS", pos)

    def _extend(self, target: Any, items: list[Any], op: str, pos: int) -> None:
        if isinstance(target, list):
            target.extend(items)
        elif isinstance(target, Call):
            target.items.extend(items)
        else:
            self.mutate(target, op, pos)

    def op_SETITEM(self, arg: Any, pos: int) -> None:
        value, key = self.pop(), self.pop()
        self._deep_keys([key], "SETITEM", pos)
        self._setitems(self.top(), [key, value], "SETITEM", pos)

    def op_SETITEMS(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        self._deep_keys(items[::2], "SETITEMS", pos)
        self._setitems(self.top(), items, "SETITEMS", pos)

    def _setitems(self, target: Any, items: list[Any], op: str, pos: int) -> None:
        if isinstance(target, dict):
            _set_items(target, items)
        elif isinstance(target, Call):
            target.items.extend(zip(items[::2], items[1::2]))
        else:
            self.mutate(target, op, pos)

    def op_ADDITEMS(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        self._deep_keys(items, "ADDITEMS", pos)
        target = self.top()
        if isinstance(target, set):
            target.update(i for i in items if _hashable(i))
        else:
            self.mutate(target, "ADDITEMS", pos)

    def op_BUILD(self, arg: Any, pos: int) -> None:
        state = self.pop()
        target = self.top()
        if isinstance(target, Call):
            if target.built:  # pickle writes one BUILD per object; a second one calls what the first set
                what = getattr(target.func, "full", "call result")
                self.r.problems.append(f"BUILD at byte {pos} gives a {what} state a second time "
                                       "(pickle then calls the __setstate__ the first BUILD may have set)")
            target.state, target.built = state, True
        elif isinstance(target, Ref):
            self.mutate(target, "BUILD", pos)
        else:
            self.r.problems.append(f"BUILD at byte {pos} gives state to a {type(target).__name__}, "
                                   "which no unpickler allows")

    def op_POP(self, arg: Any, pos: int) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_POP_MARK(self, arg: Any, pos: int) -> None:
        self.pop_mark()

    def op_DUP(self, arg: Any, pos: int) -> None:
        self.push(self.top())

    def _put(self, index: int) -> None:
        if index < 0:
            raise _Malformed("negative memo index")
        self.memo[index] = self.top()

    def op_PUT(self, arg: int, pos: int) -> None:
        self._put(arg)

    op_BINPUT = op_LONG_BINPUT = op_PUT

    def op_MEMOIZE(self, arg: Any, pos: int) -> None:
        self._put(len(self.memo))

    def op_GET(self, arg: int, pos: int) -> None:
        if arg not in self.memo:
            raise _Malformed(f"memo entry {arg} is read before it is written")
        self.push(self.memo[arg])

    op_BINGET = op_LONG_BINGET = op_GET

    def op_GLOBAL(self, arg: tuple[str, str], pos: int) -> None:
        self.push(self.ref(*arg, "GLOBAL", pos))

    def op_STACK_GLOBAL(self, arg: Any, pos: int) -> None:
        name, module = self.pop(), self.pop()
        if isinstance(module, str) and isinstance(name, str):
            self.push(self.ref(module, name, "STACK_GLOBAL", pos))
        else:
            self.r.problems.append(f"STACK_GLOBAL at byte {pos} takes a name that is not a constant string")
            self.push(Ref("<unknown>", "<unknown>"))

    def op_INST(self, arg: tuple[str, str], pos: int) -> None:
        module, name = arg
        args = tuple(self.pop_mark())
        ref = self.ref(module, name, "INST", pos)
        call = Call(ref, args, op="INST")
        self.r.calls.append(call)
        self.push(call)

    def op_OBJ(self, arg: Any, pos: int) -> None:
        items = self.pop_mark()
        if not items:
            raise _Malformed("OBJ without a class")
        self.call(items[0], tuple(items[1:]), "OBJ", pos)

    def op_NEWOBJ(self, arg: Any, pos: int) -> None:
        args, cls = self.pop(), self.pop()
        self.call(cls, args, "NEWOBJ", pos)

    def op_NEWOBJ_EX(self, arg: Any, pos: int) -> None:
        _kwargs, args, cls = self.pop(), self.pop(), self.pop()
        self.call(cls, args, "NEWOBJ_EX", pos)

    def op_REDUCE(self, arg: Any, pos: int) -> None:
        args, func = self.pop(), self.pop()
        self.call(func, args, "REDUCE", pos)

    def op_PERSID(self, arg: Any, pos: int) -> None:
        self.push(Persistent(arg))
        self.r.persistent_ids.append(arg)

    def op_BINPERSID(self, arg: Any, pos: int) -> None:
        pid = self.pop()
        self.push(Persistent(pid))
        self.r.persistent_ids.append(pid)

    def op_EXT1(self, arg: int, pos: int) -> None:
        # copyreg's extension registry maps the code to a global in the *loading* process.
        self.push(self.ref("copyreg", f"<extension code {arg}>", "EXT", pos))

    op_EXT2 = op_EXT4 = op_EXT1

    def op_NEXT_BUFFER(self, arg: Any, pos: int) -> None:
        self.push(b"")

    def op_STOP(self, arg: Any, pos: int) -> None:
        self.r.value = self.pop()


_NEW: dict[str, Callable[[], Any]] = {"NONE": lambda: None, "NEWTRUE": lambda: True, "NEWFALSE": lambda: False,
                                      "EMPTY_TUPLE": tuple, "EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}
_CONSTANTS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
})


def _hashable(value: Any) -> bool:
    """Whether ``value`` can be hashed *safely*: hashing a tuple recurses in C without a depth check,
    so a million nested tuples would crash the scanner; deeply nested ones count as unhashable."""
    if type(value) in (str, int, bytes, float, bool) or value is None:
        return True
    if _too_deep(value):
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _too_deep(value: Any) -> bool:
    """A hashable container nested past the limit max_depth (counted iteratively)."""
    limit = _limits.current().max_depth
    stack = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (tuple, frozenset)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in x)
    return False


def _set_items(d: dict[Any, Any], items: list[Any]) -> None:
    if len(items) % 2:
        raise _Malformed("odd number of items for a dict")
    for k, v in zip(items[::2], items[1::2]):
        if _hashable(k):
            d[k] = v

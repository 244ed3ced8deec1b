"""The pickle opcodes, one handler each, for ckptfix's restricted unpickler (:mod:`ckptfix.parse.unpickler`).

Each handler takes the running unpickler ``u`` (its stack, memo and reads) and does what Python's
``pickle`` does for that opcode, except where the policy decides: a global is resolved through
``u.find_class``, every call (REDUCE, NEWOBJ, OBJ, INST) goes through ``u.call``, BUILD through the
policy's handler for the instance's exact type, container keys through ``u.hashable``.
"""

from __future__ import annotations

import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

from ..core.units import shown
from . import pickle_args as args_of

_compat: Any = None

#: the longest ``module.qualname`` a pickle may name: far past any real module's, short enough that no report
#: or message carries megabytes of one name (torch's weights-only unpickler refuses such a global anyway)
MAX_GLOBAL_NAME = 1024


class Refused(pickle.UnpicklingError):
    """The pickle asks for something the policy does not allow (named in ``name`` when a global)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


def decode_name(module: str, name: str) -> tuple[str, str]:
    """The (module, name) an unpickler resolves, after Python 2 renames (``__builtin__`` → ``builtins``),
    as torch's weights_only unpickler maps them; the scanner resolves names the same way. A name longer than
    :data:`MAX_GLOBAL_NAME` is refused (UnpicklingError)."""
    global _compat
    if len(module) + 1 + len(name) > MAX_GLOBAL_NAME:
        raise pickle.UnpicklingError(f"a global named {shown(module + '.' + name)} is {len(module) + 1 + len(name):,} characters "
                          f"long, longer than any module's name (at most {MAX_GLOBAL_NAME:,})")
    if _compat is None:
        import _compat_pickle

        _compat = _compat_pickle
    if (module, name) in _compat.NAME_MAPPING:
        return _compat.NAME_MAPPING[(module, name)]
    return _compat.IMPORT_MAPPING.get(module, module), name


def type_name(obj: Any) -> str:
    """``module.qualname`` of a class or function, else of its type (for messages)."""
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"



# -- opcodes -----------------------------------------------------------------------------------------

DISPATCH: dict[int, Callable[[Any], None]] = {}


def _op(code: bytes) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def register(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        DISPATCH[code[0]] = fn
        return fn

    return register


def _push(value_of: Callable[[Any], Any]) -> Callable[[Any], None]:
    def handler(u: Any) -> None:
        u.stack.append(value_of(u))

    return handler


def stop(u: Any) -> None:  # pragma: no cover - load() returns on it
    raise AssertionError


DISPATCH[pickle.STOP[0]] = stop


@_op(pickle.PROTO)
def _proto(u: Any) -> None:
    proto = u.read_exact(1)[0]
    if proto > pickle.HIGHEST_PROTOCOL:
        raise pickle.UnpicklingError(f"unsupported pickle protocol: {proto}")
    u.proto = proto


@_op(pickle.FRAME)
def _frame(u: Any) -> None:
    u.read_exact(8)  # a length hint for buffering; the opcodes are read one by one anyway


for _code, _fn in {
    pickle.NONE: lambda u: None, pickle.NEWTRUE: lambda u: True, pickle.NEWFALSE: lambda u: False,
    pickle.EMPTY_TUPLE: lambda u: (), pickle.EMPTY_LIST: lambda u: [], pickle.EMPTY_DICT: lambda u: {},
    pickle.EMPTY_SET: lambda u: set(),
    pickle.BININT: lambda u: struct.unpack("<i", u.read_exact(4))[0],
    pickle.BININT1: lambda u: _memo_index(u, 1),
    pickle.BININT2: lambda u: struct.unpack("<H", u.read_exact(2))[0],
    pickle.BINFLOAT: lambda u: struct.unpack(">d", u.read_exact(8))[0],
    pickle.LONG1: lambda u: pickle.decode_long(u.read_exact(u.read_exact(1)[0])),
    pickle.LONG4: lambda u: pickle.decode_long(u.read_exact(_length(u, "<i", 4))),
    pickle.FLOAT: lambda u: args_of.float_arg(u.readline_()),
    pickle.BINBYTES: lambda u: u.read_exact(_length(u, "<I", 4)),
    pickle.SHORT_BINBYTES: lambda u: u.read_exact(u.read_exact(1)[0]),
    pickle.BINBYTES8: lambda u: u.read_exact(_length(u, "<Q", 8)),
    pickle.BYTEARRAY8: lambda u: bytearray(u.read_exact(_length(u, "<Q", 8))),
    pickle.BINUNICODE: lambda u: str(u.read_exact(_memo_index(u, 4)), "utf-8", "surrogatepass"),
    pickle.SHORT_BINUNICODE: lambda u: str(u.read_exact(u.read_exact(1)[0]), "utf-8", "surrogatepass"),
    pickle.BINUNICODE8: lambda u: str(u.read_exact(_length(u, "<Q", 8)), "utf-8", "surrogatepass"),
    pickle.UNICODE: lambda u: args_of.unicode_arg(u.readline_()),
    pickle.INT: lambda u: args_of.int_arg(u.readline_()),
    pickle.LONG: lambda u: args_of.long_arg(u.readline_()),
    pickle.STRING: lambda u: u.decode_string(args_of.string_arg(u.readline_())),
    pickle.BINSTRING: lambda u: u.decode_string(u.read_exact(_length(u, "<i", 4))),
    pickle.SHORT_BINSTRING: lambda u: u.decode_string(u.read_exact(u.read_exact(1)[0])),
}.items():
    DISPATCH[_code[0]] = _push(_fn)


def _length(u: Any, fmt: str, size: int) -> int:
    n = struct.unpack(fmt, u.read_exact(size))[0]
    if n < 0 or n > sys.maxsize:
        raise pickle.UnpicklingError("a length in the pickle is negative or too large")
    return n


@_op(pickle.MARK)
def _mark(u: Any) -> None:
    u.metastack.append(u.stack)
    u.stack = []


@_op(pickle.POP)
def _pop(u: Any) -> None:
    if u.stack:
        u.stack.pop()
    else:
        u.pop_mark()


@_op(pickle.POP_MARK)
def _pop_mark(u: Any) -> None:
    u.pop_mark()


@_op(pickle.DUP)
def _dup(u: Any) -> None:
    u.stack.append(u.top())


@_op(pickle.TUPLE)
def _tuple(u: Any) -> None:
    items = u.pop_mark()
    u.stack.append(tuple(items))


@_op(pickle.TUPLE1)
def _tuple1(u: Any) -> None:
    value = u.pop()
    u.stack.append((value,))


@_op(pickle.TUPLE2)
def _tuple2(u: Any) -> None:
    b, a = u.pop(), u.pop()
    u.stack.append((a, b))


@_op(pickle.TUPLE3)
def _tuple3(u: Any) -> None:
    c, b, a = u.pop(), u.pop(), u.pop()
    u.stack.append((a, b, c))


@_op(pickle.LIST)
def _list(u: Any) -> None:
    items = u.pop_mark()
    u.stack.append(items)


@_op(pickle.DICT)
def _dict(u: Any) -> None:
    items = u.pop_mark()
    if len(items) % 2:
        raise pickle.UnpicklingError("odd number of items for DICT")
    u.stack.append({u.hashable(items[i]): items[i + 1] for i in range(0, len(items), 2)})


@_op(pickle.FROZENSET)
def _frozenset(u: Any) -> None:
    items = u.pop_mark()
    u.stack.append(frozenset(u.hashable(v) for v in items))


@_op(pickle.APPEND)
def _append(u: Any) -> None:
    value = u.pop()
    _list_target(u, "APPEND").append(value)


@_op(pickle.APPENDS)
def _appends(u: Any) -> None:
    items = u.pop_mark()
    _list_target(u, "APPENDS").extend(items)


def _list_target(u: Any, op: str) -> list:
    return _target(u, op, u.policy.append, "only lists can be appended to")


def _target(u: Any, op: str, allowed: tuple[type, ...], what: str) -> Any:
    """The object on top of the stack when its exact type is one the policy lets ``op`` fill."""
    target = u.top()
    if type(target) not in allowed:
        raise Refused(f"{op} on a {type_name(target)}: {what}")
    return target


@_op(pickle.SETITEM)
def _setitem(u: Any) -> None:
    value, key = u.pop(), u.pop()
    _dict_target(u, "SETITEM")[u.hashable(key)] = value


@_op(pickle.SETITEMS)
def _setitems(u: Any) -> None:
    items = u.pop_mark()
    if len(items) % 2:
        raise pickle.UnpicklingError("odd number of items for SETITEMS")
    target = _dict_target(u, "SETITEMS")
    for i in range(0, len(items), 2):
        target[u.hashable(items[i])] = items[i + 1]


def _dict_target(u: Any, op: str) -> dict:
    return _target(u, op, u.policy.setitem, "only dicts can be filled")


@_op(pickle.ADDITEMS)
def _additems(u: Any) -> None:
    items = u.pop_mark()
    target = u.top()
    if type(target) is not set:
        raise Refused(f"ADDITEMS on a {type_name(target)}: only sets can be filled")
    target.update(u.hashable(v) for v in items)


def _memo_index(u: Any, size: int) -> int:
    if size == 0:
        return args_of.memo_arg(u.readline_())
    data = u.read(size)
    if len(data) != size:
        raise pickle.UnpicklingError("pickle data was truncated")
    return data[0] if size == 1 else int.from_bytes(data, "little")


def _get(size: int) -> Callable[[Any], None]:
    def handler(u: Any) -> None:
        i = _memo_index(u, size)
        try:
            u.stack.append(u.memo[i])
        except KeyError:
            raise pickle.UnpicklingError(f"memo value {i} is read before it is written") from None

    return handler


def _put(size: int) -> Callable[[Any], None]:
    def handler(u: Any) -> None:
        i = _memo_index(u, size)
        if i < 0:
            raise pickle.UnpicklingError("negative PUT argument")
        u.memo[i] = u.top()

    return handler


for _code, _size in ((pickle.GET, 0), (pickle.BINGET, 1), (pickle.LONG_BINGET, 4)):
    DISPATCH[_code[0]] = _get(_size)
for _code, _size in ((pickle.PUT, 0), (pickle.BINPUT, 1), (pickle.LONG_BINPUT, 4)):
    DISPATCH[_code[0]] = _put(_size)


@_op(pickle.MEMOIZE)
def _memoize(u: Any) -> None:
    u.memo[len(u.memo)] = u.top()


@_op(pickle.GLOBAL)
def _global(u: Any) -> None:
    module = args_of.name_arg(u.readline_(), "utf-8")
    name = args_of.name_arg(u.readline_(), "utf-8")
    u.stack.append(u.find_class(*decode_name(module, name)))


@_op(pickle.STACK_GLOBAL)
def _stack_global(u: Any) -> None:
    name, module = u.pop(), u.pop()
    if type(name) is not str or type(module) is not str:
        raise Refused("STACK_GLOBAL requires str names")
    u.stack.append(u.find_class(*decode_name(module, name)))


def _ext(size: int) -> Callable[[Any], None]:
    def handler(u: Any) -> None:
        code = u.read_exact(size)
        raise Refused(f"copyreg extension code {int.from_bytes(code, 'little')} (resolved by the loading "
                      "process's registry) is never allowed", "copyreg.<extension code>")

    return handler


DISPATCH[pickle.EXT1[0]], DISPATCH[pickle.EXT2[0]], DISPATCH[pickle.EXT4[0]] = _ext(1), _ext(2), _ext(4)


@_op(pickle.PERSID)
def _persid(u: Any) -> None:
    pid = args_of.persid_arg(u.readline_())
    u.stack.append(_persistent(u, pid))


@_op(pickle.BINPERSID)
def _binpersid(u: Any) -> None:
    pid = u.pop()
    u.stack.append(_persistent(u, pid))


def _persistent(u: Any, pid: Any) -> Any:
    if not u.policy.persistent:
        raise Refused("persistent ids are not allowed in this pickle")
    if type(pid) is not tuple or not pid or pid[0] not in ("storage", b"storage"):
        raise Refused(f"persistent id {pid!r:.60}: only torch storages may be referenced")
    storage = u.persistent_load(pid)
    if len(pid) == 6 and pid[5] is None and type(pid[2]) is str:  # a legacy file's root storage
        first = u.storages.setdefault(pid[2], storage)
        untyped = getattr(storage, "_untyped_storage", None)
        if first is not storage and untyped is not None and untyped.device.type == "meta" and untyped.nbytes() == 0:
            # torch's skip_data read hands an empty storage to a second user of a meta storage;
            # the first one has the declared size, so every view is checked against that
            return first
    return storage


@_op(pickle.REDUCE)
def _reduce(u: Any) -> None:
    args = u.pop()
    func = u.pop()
    u.stack.append(u.call(func, args, None, "REDUCE"))


@_op(pickle.NEWOBJ)
def _newobj(u: Any) -> None:
    args = u.pop()
    cls = u.pop()
    u.stack.append(_new(u, cls, args, "NEWOBJ"))


@_op(pickle.NEWOBJ_EX)
def _newobj_ex(u: Any) -> None:
    kwargs = u.pop()
    args = u.pop()
    cls = u.pop()
    if kwargs:
        raise Refused("NEWOBJ_EX with keyword arguments is not allowed")
    u.stack.append(_new(u, cls, args, "NEWOBJ_EX"))


def _new(u: Any, cls: Any, args: Any, op: str) -> Any:
    if not isinstance(args, tuple):
        raise pickle.UnpicklingError(f"{op} args must be a tuple")
    if u.is_placeholder(cls) or id(cls) in u.policy.calls and id(cls) not in u.policy.newobj:
        return u.call(cls, args, None, op)  # e.g. Parameter(data, requires_grad): through its guard; a placeholder
    if id(cls) not in u.policy.newobj or not isinstance(cls, type):
        raise Refused(f"{op} creates a {type_name(cls)}, which ckptfix never creates from untrusted data",
                      type_name(cls))
    u.charge(sum(len(a) for a in args if isinstance(a, (str, bytes, tuple, list))), op)
    return cls.__new__(cls, *args)


@_op(pickle.OBJ)
def _obj(u: Any) -> None:
    items = u.pop_mark()
    if not items:
        raise pickle.UnpicklingError("OBJ without a class")
    value = u.call(items[0], tuple(items[1:]), None, "OBJ")
    u.stack.append(value)


@_op(pickle.INST)
def _inst(u: Any) -> None:
    module = args_of.name_arg(u.readline_(), "ascii")
    name = args_of.name_arg(u.readline_(), "ascii")
    cls = u.find_class(*decode_name(module, name))
    args = tuple(u.pop_mark())
    u.stack.append(u.call(cls, args, None, "INST"))


@_op(pickle.BUILD)
def _build(u: Any) -> None:
    state = u.pop()
    inst = u.top()
    handler = u.policy.build.get(type(inst))
    if handler is None or isinstance(inst, type):
        raise Refused(f"BUILD on a {type_name(inst)}: only instances of allowed types made by this pickle "
                      "may get state (never a class or function)")
    handler(u, inst, state)


def _refuse_buffers(u: Any) -> None:
    raise Refused("out-of-band buffers (pickle protocol 5) are not supported")


DISPATCH[pickle.NEXT_BUFFER[0]] = DISPATCH[pickle.READONLY_BUFFER[0]] = _refuse_buffers



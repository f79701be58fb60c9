"""What a torch call does to a managed parameter, and the torch internals zinf reaches
tensors through (the data under zinf's property, the storage a tensor lies in).

classify() sorts a call into META (neither reads nor writes the values), READ or WRITE before
its arguments are looked at; _access.py says what each kind does to a managed parameter.
"""
import torch

DISABLE = torch._C.DisableTorchFunction
_BASE_DATA = torch._C._TensorBase.data


def base_data(t):
    """t.data without zinf's property (the placeholder or the acquired memory)."""
    with DISABLE():
        return _BASE_DATA.__get__(t)


def set_base_data(t, value):
    with DISABLE():
        _BASE_DATA.__set__(t, value)


def storage_ptr(t):
    try:
        return t.untyped_storage().data_ptr()
    except AttributeError:  # torch < 2.0
        return t.storage().data_ptr()


def plain(t):
    """`t` as an ordinary tensor (a ZinfParameter's or a Snapshot's memory, no subclass)."""
    with DISABLE():
        return t.as_subclass(torch.Tensor)


# ---- What a torch call is ---------------------------------------------------------------------

META, READ, WRITE = "meta", "read", "write"

# Methods that neither read the values nor write them.
_META_METHODS = {
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "get_device", "is_floating_point", "is_complex", "is_signed", "ndimension",
    "requires_grad_", "retain_grad", "register_hook", "__hash__", "__len__", "is_shared",
    "share_memory_", "_is_view", "has_names", "data_ptr", "untyped_storage", "storage",
    "_typed_storage", "is_set_to", "__setstate__", "_fix_weakref", "detach_", "is_pinned",
    "is_inference", "__sizeof__", "__dir__", "_register_access_hook", "dim_order",
    "_has_compatible_shallow_copy_type",
}
# Attribute getters that are views of the values (other getters are metadata).
_VIEW_GETTERS = {"T", "mT", "H", "mH", "real", "imag", "data"}
# In-place operators that do not end with "_".
_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    "__setitem__",
}
_cache = {}


def classify(func, kwargs):
    """META, READ or WRITE for a torch call (before looking at its arguments)."""
    if kwargs and kwargs.get("out") is not None:
        return WRITE
    kind = _cache.get(func)
    if kind is not None:
        return kind
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__":
            return READ if attr in _VIEW_GETTERS else META
        return WRITE if attr == "data" else META  # every other setter: grad, requires_grad
    if name in _META_METHODS:
        kind = META
    elif name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
        kind = WRITE
    else:
        kind = READ
    try:
        _cache[func] = kind
    except TypeError:  # not hashable
        pass
    return kind


def call_tensors(args, kwargs):
    """The tensors among a call's arguments (and one level inside lists and tuples)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def written_tensors(args, kwargs):
    """The tensors a write call writes: `out=`, or its first argument (a list for _foreach)."""
    if kwargs and kwargs.get("out") is not None:
        target = kwargs["out"]
    elif args:
        target = args[0]
    else:  # torch.nn.init passes its tensor by keyword
        target = next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
    if isinstance(target, (list, tuple)):
        return [t for t in target if isinstance(t, torch.Tensor)]
    return [target] if isinstance(target, torch.Tensor) else []


def replace_tensor(obj, old, new):
    """`obj` (an argument) with the tensor `old` replaced by `new`, lists and tuples too."""
    if obj is old:
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(replace_tensor(o, old, new) for o in obj)
    return obj


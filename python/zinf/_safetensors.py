"""Hugging Face safetensors checkpoints into and out of a ZinfEngine (the format is read and
written by zinf's C++ code: no Python dependency, one tensor in host memory at a time)."""
import os

import torch

from . import _zinf
from ._checkpoint import persistent_buffers
from ._engine import ZinfError, context_of


# torch dtype <-> the format's dtype names (little-endian bytes, as torch keeps them here).
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_FLOAT_NAMES = ("F32", "BF16", "F16")


def _mapper(name_map):
    if name_map is None:
        return lambda n: n
    if callable(name_map):
        return name_map
    if isinstance(name_map, dict):
        return lambda n: name_map.get(n, n)
    raise TypeError("name_map: a dict (model name -> checkpoint name), a callable or None")


def load_safetensors(engine, path, name_map=None, strict=True, allow_reshape=False):
    """Loads the tensors of a .safetensors file, a sharded checkpoint's
    model.safetensors.index.json, or a folder holding either, into the engine's parameters
    (the fp32 masters and the parameter stores) and the model's buffers.

    `name_map` turns a model name (a name from model.named_parameters(), any of a tied
    parameter's names, or a buffer's) into the checkpoint's name: a dict, a callable returning
    the name, or None (the same names). With `strict`, every parameter must be found and every
    tensor of the checkpoint used. F32, BF16 and F16 tensors load (converted exactly to fp32).
    Every name, shape and dtype is checked before anything changes; a missing shard or a
    damaged header is an error naming the file. Optimizer states are left as they are.
    Returns {"loaded": [...], "missing": [...], "unexpected": [...]}.
    """
    ctx = context_of(engine)
    ctx.enter("load_safetensors")
    ctx.between_steps("zinf.load_safetensors")
    ckpt = _zinf.Safetensors(str(path))
    tensors = ckpt.tensors()
    to_file = _mapper(name_map)
    mapping, loaded, missing, used = [], [], [], set()
    for p in ctx.registry.params:
        found = None
        for n in p.names:
            f = to_file(n)
            if f is not None and f in tensors:
                found = f
                break
        if found is None:
            missing.append(p.names[0])
            continue
        mapping.append((p.id, found))
        loaded.append(p.names[0])
        used.add(found)
    buffers = []
    for name, buf in persistent_buffers(engine.module).items():
        f = to_file(name)
        if f is None or f not in tensors:
            continue
        dtype, shape, _ = tensors[f]
        # A float tensor loads into a float buffer (converted); any other dtype only into a
        # buffer of that very dtype (BatchNorm's I64 num_batches_tracked), byte for byte.
        fits = list(shape) == list(buf.shape) and (
            (dtype in _FLOAT_NAMES and buf.is_floating_point()) or
            _ST_DTYPES.get(buf.dtype) == dtype)
        if not fits:
            raise ZinfError("tensor '%s' (%s %s) does not fit buffer '%s' (%s %s); nothing was "
                            "loaded" % (f, dtype, list(shape), name, buf.dtype, list(buf.shape)))
        buffers.append((buf, f, dtype))
        used.add(f)
    unexpected = sorted(set(tensors) - used)
    if strict and (missing or unexpected):
        what = []
        if missing:
            what.append("no tensor for parameter(s) %s" % ", ".join(repr(m) for m in missing[:8])
                        + (" and %d more" % (len(missing) - 8) if len(missing) > 8 else ""))
        if unexpected:
            what.append("unused tensor(s) %s" % ", ".join(repr(u) for u in unexpected[:8])
                        + (" and %d more" % (len(unexpected) - 8) if len(unexpected) > 8 else ""))
        raise ZinfError("load_safetensors(%s): %s; nothing was loaded (pass name_map, or "
                        "strict=False)" % (path, "; ".join(what)))
    ctx.core.load_safetensors(ckpt, mapping, allow_reshape)
    ctx.values_set()
    for buf, f, dtype in buffers:
        if dtype in _FLOAT_NAMES:
            values = torch.empty(buf.shape, dtype=torch.float32)
            ckpt.read_f32(f, values.data_ptr())
        else:
            values = _read_raw(ckpt, f, buf.dtype, buf.shape)
        with torch.no_grad():
            buf.copy_(values)
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected}


def _read_raw(ckpt, name, dtype, shape):
    """A tensor's bytes as they are in its file (a dtype the float reader does not convert)."""
    path, offset, nbytes = ckpt.location(name)
    out = torch.empty(shape, dtype=dtype)
    if out.numel() * out.element_size() != nbytes:
        raise ZinfError("tensor '%s' in %s: %d bytes for a %s tensor of shape %s"
                        % (name, path, nbytes, dtype, list(shape)))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise ZinfError("tensor '%s' in %s: the file ends inside its data" % (name, path))
    out.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return out


def save_safetensors(engine, save_dir, shard_size="5G", dtype=torch.float32, metadata=None,
                     buffers=None, trainable_only=False):
    """Exports the parameters' values (fp32, or bf16 rounded to nearest even) as
    model.safetensors, or as model-0000i-of-0000K.safetensors shards of at most `shard_size`
    bytes ("5G", "500M" or a number) with model.safetensors.index.json, under each parameter's
    first name (tied parameters once). With `buffers` (the default unless `trainable_only`)
    the model's persistent buffers follow under their state_dict names, as state_dict() has
    them (BatchNorm's running statistics: a model exported and loaded elsewhere evaluates the
    same); float buffers in `dtype`, others (num_batches_tracked) as they are.

    `trainable_only`: only the parameters registered trainable (requires_grad at
    zinf.initialize, and in model_parameters when given): a LoRA run's adapters, without the
    frozen base. Buffers are then left out unless `buffers=True` is passed (they belong to
    the base). One tensor in host memory at a time; every file is written to a temporary name
    and renamed, the index last."""
    ctx = context_of(engine)
    ctx.enter("save_safetensors")
    ctx.between_steps("zinf.save_safetensors")
    if isinstance(shard_size, str):
        shard_bytes = _zinf.parse_byte_size(shard_size, "shard_size")
    else:
        shard_bytes = int(shard_size)
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    if dtype not in names:
        raise ZinfError("save_safetensors: dtype torch.float32 or torch.bfloat16")
    meta = {"format": "pt"}
    meta.update(metadata or {})
    params = ctx.registry.params
    if trainable_only:
        params = [p for p in params if p.trainable]
        if not params:
            raise ZinfError("save_safetensors(trainable_only=True): the engine trains no "
                            "parameter (every one was frozen at zinf.initialize); nothing to "
                            "export (pass trainable_only=False to export the model)")
    if buffers is None:
        buffers = not trainable_only
    mapping = [(p.id, p.names[0]) for p in params]
    extra, keep = [], []
    if buffers:
        for name, buf in persistent_buffers(engine.module).items():
            t = buf.detach()
            if t.is_floating_point():
                t = t.to(dtype)
            if t.dtype not in _ST_DTYPES:
                raise ZinfError("save_safetensors: buffer '%s' is %s, which safetensors has no "
                                "name for (pass buffers=False to leave buffers out)"
                                % (name, t.dtype))
            t = t.to("cpu").contiguous()
            keep.append(t)
            extra.append((name, _ST_DTYPES[t.dtype], list(t.shape), t.data_ptr()))
    ctx.core.save_safetensors(str(save_dir), mapping, shard_bytes, names[dtype], meta, extra)
    del keep

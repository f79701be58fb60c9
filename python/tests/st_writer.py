"""A safetensors writer for the tests, written from the format's description (independent of
zinf's own writer): an 8-byte little-endian header length, the JSON header, the data."""
import json
import struct

import torch

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def tensor_bytes(t):
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def write_file(path, tensors, metadata=None):
    header, blobs, at = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        b = tensor_bytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def write_sharded(folder, tensors, shards):
    """Splits `tensors` (an ordered dict) into `shards` files with an index."""
    names = list(tensors)
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    for k in range(shards):
        fname = "model-%05d-of-%05d.safetensors" % (k + 1, shards)
        part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
        write_file(folder + "/" + fname, part)
        weight_map.update({n: fname for n in part})
    with open(folder + "/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def read_file(path):
    """{name: tensor} of one file (for checking what zinf exported)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = bytearray(data[b:e])
        if info["dtype"] == "F32":
            t = torch.frombuffer(raw, dtype=torch.float32)
        elif info["dtype"] == "BF16":
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16)
        elif info["dtype"] == "F16":
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.float16)
        elif info["dtype"] == "I64":
            t = torch.frombuffer(raw, dtype=torch.int64) if raw else \
                torch.zeros(0, dtype=torch.int64)
        else:
            raise ValueError(info["dtype"])
        out[name] = t.reshape(info["shape"]).clone()
    return out

"""The verifier's wire to a candidate's process: JSON headers and raw tensor bytes, no pickle.

Data flow: a tensor --pack--> ({dtype, shape, blob index}, bytes) --send (12-byte prefix, JSON,
the blobs; file descriptors beside the prefix)--> recv --unpack (only the dtypes in DTYPES)--> a
tensor. Shared memory: a memfd both processes map (memfd/map/layout/view) on the host, CUDA IPC
handles (cuda_handle/from_cuda_handle) on the GPU. The receiving side decodes numbers and never
objects, so a candidate's process can send nothing but data.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Any

import torch

DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
CTX_TENSORS = ("slot_mapping", "block_tables", "context_lens", "query_start_loc", "last_token_indices")
_PREFIX = struct.Struct("<IQ")  # JSON length, bytes of the blobs after it
ALIGN = 64


# ------------------------------------------------------------------ the wire: JSON + raw bytes


def pack(t: torch.Tensor, blobs: list[bytes]) -> dict[str, Any]:
    name = str(t.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise TypeError(f"dtype {t.dtype} cannot cross the verification boundary")
    flat = t.detach().reshape(-1).contiguous().cpu()
    blobs.append(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return {"dtype": name, "shape": list(t.shape), "blob": len(blobs) - 1}


def unpack(desc: dict[str, Any], blobs: list[bytes]) -> torch.Tensor:
    dtype = DTYPES[desc["dtype"]]  # KeyError: not an allowed dtype
    shape = [int(n) for n in desc["shape"]]
    raw = blobs[int(desc["blob"])]
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def send(sock: socket.socket, header: dict[str, Any], blobs: list[bytes] = (), fds: list[int] = ()) -> None:
    header = {**header, "blobs": [len(b) for b in blobs]}
    text = json.dumps(header).encode()
    prefix = _PREFIX.pack(len(text), sum(len(b) for b in blobs))
    if fds:
        sent = socket.send_fds(sock, [prefix], list(fds))
        if sent < len(prefix):
            sock.sendall(prefix[sent:])
    else:
        sock.sendall(prefix)
    sock.sendall(text)
    for b in blobs:
        if b:
            sock.sendall(b)


MAX_HEADER_BYTES = 16 << 20  # a message's JSON; its tensors at most MAX_BLOB_BYTES together
MAX_BLOB_BYTES = 8 << 30


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:  # the whole message within the call's deadline, not each chunk
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("message not complete within the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[bytes], list[int]]:
    """One message. The socket's timeout (when set) bounds the whole message: a sender that
    trickles bytes cannot hold the receiver past it. Sizes past the limits are refused."""
    timeout = sock.gettimeout()
    deadline = None if timeout is None else time.monotonic() + timeout
    data, fds, _, _ = socket.recv_fds(sock, _PREFIX.size, 16)
    if not data:
        raise EOFError("connection closed")
    if len(data) < _PREFIX.size:
        data += _recv_exact(sock, _PREFIX.size - len(data), deadline)
    n_json, n_blobs = _PREFIX.unpack(data)
    if n_json > MAX_HEADER_BYTES or n_blobs > MAX_BLOB_BYTES:
        raise ValueError(f"message of {n_json} + {n_blobs} bytes refused (limits {MAX_HEADER_BYTES}, {MAX_BLOB_BYTES})")
    header = json.loads(_recv_exact(sock, n_json, deadline))
    if not isinstance(header, dict):
        raise ValueError("a message header must be a JSON object")
    raw = _recv_exact(sock, n_blobs, deadline) if n_blobs else b""
    blobs, at = [], 0
    for size in header.get("blobs", []):
        blobs.append(raw[at:at + int(size)])
        at += int(size)
    if timeout is not None:
        sock.settimeout(timeout)
    return header, blobs, list(fds)


# ------------------------------------------------------------------ shared memory


def memfd(nbytes: int, name: str) -> tuple[int, torch.Tensor]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, max(nbytes, ALIGN))
    return fd, map_fd(fd, max(nbytes, ALIGN))


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def layout(shapes: list[tuple[list[int], torch.dtype]]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for shape, dtype in shapes:
        offsets.append(at)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def view(base: torch.Tensor, offset: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return base[offset:offset + n].view(dtype).view(shape)


def cuda_handle(t: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC description of ``t`` (its storage's handle, offset, shape, stride)."""
    storage = t.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()
    return {"device": int(device), "handle": handle.hex(), "size": int(size), "offset": int(offset),
            "ref_handle": ref_handle.hex(), "ref_offset": int(ref_offset), "event": event.hex(), "sync": bool(sync),
            "storage_offset": t.storage_offset(), "shape": list(t.shape), "stride": list(t.stride()),
            "dtype": str(t.dtype).replace("torch.", "")}


def from_cuda_handle(d: dict[str, Any]) -> torch.Tensor:
    # The CUDA state first, as torch.multiprocessing's rebuild does: in a process whose first CUDA
    # call this is (the verifier's probe child) opening the handle without it segfaults.
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        d["device"], bytes.fromhex(d["handle"]), d["size"], d["offset"], bytes.fromhex(d["ref_handle"]),
        d["ref_offset"], bytes.fromhex(d["event"]), d["sync"])
    t = torch.empty((0,), dtype=DTYPES[d["dtype"]], device=f"cuda:{d['device']}")
    return t.set_(storage, d["storage_offset"], d["shape"], d["stride"])

"""The shared weights stay unchanged: a content fingerprint taken before a candidate runs and after.

Every pass of an engine reads the one weights dict the engine loaded; hot reload and the
verifier refuse a candidate whose build() or forward() wrote to it. The fingerprint is the
content of every tensor, not its bookkeeping: writes through ``.data`` or a NumPy view skip
the version counter, and a swap or a +d/-d pair keeps the sum. ``WeightsBaseline`` is the
fingerprint the compile loop takes before a candidate is first loaded (so damage done while
it was measured is still seen at verification), with an optional pristine copy to restore.

Data flow: weights {name: tensor} --weights_fingerprint--> {name: (data_ptr, shape, dtype,
content digest)} --fingerprint_diff(before, after)--> names that changed.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

# CUDA tensors are digested on the device in chunks of this many words (two int64 temporaries of
# this size), so a 1B model is not copied to the host to be hashed.
_DEVICE_CHUNK = 1 << 24
_M64 = (1 << 64) - 1
# The digest's key: drawn once per process, so no edit can be worked out in advance to keep the
# digest (the fingerprints compared are always taken in one process).
_KEY = int.from_bytes(os.urandom(8), "little")
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (the per-chunk keys)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


# splitmix64's finaliser on int64 tensors: (right shift, its logical mask, multiplier after it)
_ROUNDS = ((30, (1 << 34) - 1, _signed(0xBF58476D1CE4E5B9)), (27, (1 << 37) - 1, _signed(0x94D049BB133111EB)),
           (31, (1 << 33) - 1, None))


def _words(flat: Any) -> Any:
    """The tensor's bytes as its widest words of 8, 4, 2 or 1 bytes."""
    import torch

    raw = flat.view(torch.uint8)
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if raw.numel() % size == 0:
            return raw.view(dt)
    return raw


def device_digest(t: Any, key: int | None = None) -> str:
    """A digest computed where the tensor lives (any device; CUDA uses it, tests run it on the
    host): every word, with its position, goes through a non-linear 64-bit mix (splitmix64's
    finaliser of (word xor a per-chunk key) + position x an odd constant) and the mixes are summed
    per chunk; the host hashes the chunk sums with blake2b. An edit changes each word it touches
    by a pseudo-random 64-bit amount, so no pattern of edits (a swap, +k/-k pairs, +k,-k,-k,+k on
    consecutive words) keeps the sum but by chance (2^-64)."""
    import torch

    words = _words(t.detach().contiguous().view(-1))
    n = words.numel()
    h = hashlib.blake2b(f"{t.dtype}:{tuple(t.shape)}:{n}".encode(), digest_size=16)
    if n == 0:
        return h.hexdigest()
    key = _KEY if key is None else key
    size = min(n, _DEVICE_CHUNK)
    positions = torch.arange(size, device=words.device, dtype=torch.int64).mul_(_signed(_GOLDEN))
    x, tmp = torch.empty_like(positions), torch.empty_like(positions)
    sums = []
    for c, start in enumerate(range(0, n, _DEVICE_CHUNK)):
        w = words[start:start + _DEVICE_CHUNK]
        m = w.numel()
        y, z = x[:m], tmp[:m]
        y.copy_(w).bitwise_xor_(_signed(_mix64(key + c))).add_(positions[:m])
        for shift, low, mul in _ROUNDS:
            torch.bitwise_right_shift(y, shift, out=z)
            y.bitwise_xor_(z.bitwise_and_(low))
            if mul is not None:
                y.mul_(mul)
        sums.append(y.sum())
    h.update(torch.stack(sums).cpu().numpy().tobytes())  # one small copy to the host per tensor
    return h.hexdigest()


def content_digest(t: Any) -> str:
    """A digest of a tensor's bytes: blake2b of its bytes on the host; on CUDA device_digest (no
    copy of the weights to the host)."""
    import torch

    flat = t.detach().contiguous().view(-1)
    if flat.device.type != "cuda":
        return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    return device_digest(flat)


def weights_fingerprint(weights: dict[str, Any]) -> dict[str, tuple]:
    """Per tensor (data pointer, shape, dtype, content digest).

    A candidate must never change the shared weights: the incumbent and later candidates
    read them too. The data pointer catches a tensor replaced in the dict.
    """
    import torch

    out = {}
    with torch.no_grad():
        for name, t in weights.items():
            out[name] = (t.data_ptr(), tuple(t.shape), str(t.dtype), content_digest(t))
    return out


def fingerprint_diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    changed = [k for k in before if after.get(k) != before[k]]
    added = [k for k in after if k not in before]
    return sorted(changed) + [f"+{k}" for k in sorted(added)]


class WeightsBaseline:
    """The weights' fingerprint (and, with ``keep_copy``, a host copy) from before a candidate
    was first loaded: checked after measurement and after verification, and put back when a
    candidate wrote to them."""

    def __init__(self, weights: dict[str, Any], keep_copy: bool = False) -> None:
        self.fingerprint = weights_fingerprint(weights)
        self._copy = {n: t.detach().to("cpu", copy=True) for n, t in weights.items()} if keep_copy else None

    def changed(self, weights: dict[str, Any]) -> list[str]:
        return fingerprint_diff(self.fingerprint, weights_fingerprint(weights))

    def restore(self, weights: dict[str, Any]) -> list[str]:
        """Write the pristine contents back into every tensor that changed; the names restored.
        Without a copy nothing can be restored: the caller discards the engine instead."""
        import torch

        if self._copy is None:
            return []
        names = [n for n in self.changed(weights) if not n.startswith("+")]
        with torch.no_grad():
            for n in names:
                if n in weights and tuple(weights[n].shape) == tuple(self._copy[n].shape):
                    weights[n].data.copy_(self._copy[n])
        return names

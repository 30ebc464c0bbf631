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
from typing import Any

# CUDA tensors are checksummed on the device in chunks of this many elements (an int64
# temporary per chunk), so a 1B model is not copied to the host to be hashed.
_DEVICE_CHUNK = 1 << 24
_K1, _K2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)  # odd 64-bit multipliers


def content_digest(t: Any) -> str:
    """A digest of a tensor's bytes: blake2b on the host; on CUDA two position-weighted
    wrap-around sums of its 16- or 32-bit words (a swap, a sum-keeping pair of edits or a
    single flipped bit all change them)."""
    import torch

    flat = t.detach().contiguous().view(-1)
    if flat.device.type != "cuda":
        return hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    words = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32) if flat.element_size() in (2, 4) \
        else flat.view(torch.uint8)
    h1 = h2 = 0
    for start in range(0, words.numel(), _DEVICE_CHUNK):
        w = words[start:start + _DEVICE_CHUNK].long()
        idx = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64)
        h1 ^= int((w * (idx * 2 + 1) * _K1).sum())
        h2 ^= int(((w + 0x5BD1E995) * (idx ^ _K2)).sum())
    return f"{h1 & ((1 << 64) - 1):016x}{h2 & ((1 << 64) - 1):016x}"


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

"""The shared weights stay unchanged: a fingerprint taken before a candidate runs and after.

Every pass of an engine reads the one weights dict the engine loaded; hot reload and the
verifier refuse a candidate whose build() or forward() wrote to it.
"""

from __future__ import annotations

from typing import Any


def weights_fingerprint(weights: dict[str, Any]) -> dict[str, tuple]:
    """Per tensor (data pointer, shape, dtype, version counter, float64 sum).

    In-place writes bump the version counter; the sum also catches writes that
    bypass autograd bookkeeping. A candidate must never change the shared weights:
    the incumbent and later candidates read them too.
    """
    import torch

    out = {}
    with torch.no_grad():
        for name, t in weights.items():
            out[name] = (t.data_ptr(), tuple(t.shape), str(t.dtype), getattr(t, "_version", 0),
                         float(t.double().sum().item()))
    return out


def fingerprint_diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    changed = [k for k in before if after.get(k) != before[k]]
    added = [k for k in after if k not in before]
    return sorted(changed) + [f"+{k}" for k in sorted(added)]

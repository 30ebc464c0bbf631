"""The weights' content digest: on CUDA computed on the device (device_digest, exercised here on
the host tensors it computes the same way), an edit cannot cancel out of it."""

from __future__ import annotations

import torch

from shapeshift.engine.forward_pass.weights_guard import content_digest, device_digest

_K1, _K2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)


def _position_weighted_sums(t: torch.Tensor) -> tuple[int, int]:
    """The CUDA digest this one replaced: two position-weighted wrap-around sums of the words."""
    words = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).long()
    idx = torch.arange(words.numel(), dtype=torch.int64)
    return int((words * (idx * 2 + 1) * _K1).sum()), int(((words + 0x5BD1E995) * (idx ^ _K2)).sum())


def _plus_minus_minus_plus(t: torch.Tensor, at: int, k: int = 3) -> torch.Tensor:
    """+k, -k, -k, +k on four consecutive 16- or 32-bit words, in a copy."""
    out = t.clone()
    words = out.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
    for j, sign in enumerate((1, -1, -1, 1)):
        words[at + j] += sign * k
    return out


def test_an_edit_the_weighted_sums_keep_changes_the_digest():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(64, 33).to(dtype)
        tampered = _plus_minus_minus_plus(t, 100)
        assert not torch.equal(t.view(-1).view(torch.uint8), tampered.view(-1).view(torch.uint8))
        assert _position_weighted_sums(tampered) == _position_weighted_sums(t), dtype  # the old digest missed it
        assert device_digest(tampered) != device_digest(t), dtype
        for at in (1, 2, 3, 101, 1000):  # within one 8-byte word of the mix, and across two
            assert device_digest(_plus_minus_minus_plus(t, at)) != device_digest(t), (dtype, at)
        assert content_digest(tampered) != content_digest(t)


def test_the_device_digest_sees_swaps_and_single_bits_and_ignores_storage():
    t = torch.randn(40, 16, dtype=torch.bfloat16)
    base = device_digest(t)
    assert device_digest(t.clone()) == base == device_digest(torch.cat([t, t])[:40])  # contents, not storage
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert device_digest(swapped) != base
    flipped = t.clone()
    flipped.view(-1).view(torch.int16)[7] ^= 1
    assert device_digest(flipped) != base
    assert device_digest(t.view(16, 40)) != base  # the shape is part of it
    assert device_digest(t, key=1) != device_digest(t, key=2)  # keyed (one key per process)
    odd = torch.arange(7, dtype=torch.uint8)  # neither 2-, 4- nor 8-byte words
    assert device_digest(odd) != device_digest(odd.flip(0))


def test_the_device_digest_spans_chunks(monkeypatch):
    from shapeshift.engine.forward_pass import weights_guard

    monkeypatch.setattr(weights_guard, "_DEVICE_CHUNK", 64)
    t = torch.randn(1000, dtype=torch.float32)
    base = device_digest(t)
    for at in (0, 63, 64, 500, 996):
        assert device_digest(_plus_minus_minus_plus(t, at)) != base, at
    moved = torch.cat([t[64:128], t[:64], t[128:]])  # two chunks' contents exchanged
    assert device_digest(moved) != base

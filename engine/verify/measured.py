"""Check what was measured: the tokens a candidate produced in a measured replay against the
reference's on the same requests.

Verification alone is not enough: a pass can tell the gates from a measured replay (thread
names, call stacks, call counts) and be exact only while verified. The compile loop's paired
replays give both passes of a pair the same requests in the same repeat, so the incumbent's
tokens (the stock pass, or a champion verified and checked the same way) are the reference.

Data flow: ReplayRun.output_token_ids of candidate and reference, same requests, greedy
--measured_outputs_agree--> evidence {ok, requests, first_token_agreement, prefix_agreement, ...};
a measured decode rate + the model's bytes a step + the device's measured bandwidth
(measure_bandwidth) --measured_speed_possible--> evidence {ok, max_tokens_per_s, ...}.

Greedy decoding on a trajectory is chaotic after a near-tie flip, so a correct pass in half
precision may part ways with the reference late in a sequence; it agrees on the first token of
nearly every request and on most of each sequence. A pass that computes something else (a
skipped layer, another model) differs at the first token of most requests.
"""

from __future__ import annotations

from typing import Any

# A correct pass: its first token equals the reference's on at least this share of the requests,
# and the tokens before the first difference are at least this share of all tokens.
MIN_FIRST_TOKEN_AGREEMENT = 0.9
MIN_PREFIX_AGREEMENT = 0.5
# The same in half precision (bf16, fp16), where a change of schedule alone (another prefill
# chunk, another batch width) changes the rounding of every step: on an H200, llama-3.2-1b-shape
# (random bf16 weights, nearly flat next-token distributions) with max_num_batched_tokens 256,
# 512 or 1024 against 2048 agreed on 100% of first tokens and on 21%, 26% and 34% of token
# prefixes, the same code. Measured as served (each candidate's serving loop in its own process,
# so which requests share a step follows the arrival of messages), the Triton kernels with fused
# projections against the stock pass agreed on 98% of first tokens and 9% of token prefixes
# (H200, 64 chat requests, tests/compile/test_compile_gpu.py at 87fd1b9). A pass that is right on
# the first token and wrong after it keeps about one token of each sequence (under 1% of a
# 200-token output): this floor still refuses it.
MIN_PREFIX_AGREEMENT_HALF = 0.03


def min_prefix_agreement(dtype: Any = None) -> float:
    """The prefix floor for outputs computed in `dtype` (a torch dtype or its name; None: full precision)."""
    return MIN_PREFIX_AGREEMENT_HALF if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") \
        else MIN_PREFIX_AGREEMENT


def measured_outputs_agree(candidate: list[list[int]], reference: list[list[int]], dtype: Any = None) -> dict[str, Any]:
    min_prefix = min_prefix_agreement(dtype)
    if len(candidate) != len(reference):
        return {"ok": False, "reason": f"{len(candidate)} outputs for {len(reference)} requests"}
    firsts = prefix = total = 0
    lengths_differ = []
    for i, (c, r) in enumerate(zip(candidate, reference)):
        if len(c) != len(r):
            lengths_differ.append(i)
        n = 0
        while n < min(len(c), len(r)) and c[n] == r[n]:
            n += 1
        firsts += int(bool(r) and n > 0)
        prefix += n
        total += len(r)
    first_share = firsts / len(reference) if reference else 1.0
    prefix_share = prefix / total if total else 1.0
    ok = not lengths_differ and first_share >= MIN_FIRST_TOKEN_AGREEMENT and prefix_share >= min_prefix
    ev: dict[str, Any] = {"ok": ok, "requests": len(reference), "first_token_agreement": round(first_share, 4),
                          "prefix_agreement": round(prefix_share, 4), "min_first_token_agreement":
                          MIN_FIRST_TOKEN_AGREEMENT, "min_prefix_agreement": min_prefix}
    if lengths_differ:
        ev["output_lengths_differ"] = lengths_differ[:8]
    if not ok:
        ev["reason"] = ("measured outputs diverge from the reference's on the same requests "
                        f"(first tokens agree on {first_share:.0%}, token prefixes on {prefix_share:.0%})")
    return ev


# ------------------------------------------------------------------ speed of light on measured results
#
# A measured decode rate is physics-bound: each decode step of B sequences reads every weight
# (and each sequence's KV) at least once, so B tokens per step cannot come faster than the
# bytes of a step over the device's memory bandwidth (or its FLOPs over peak). A result faster
# than that is a measurement fault (a clock that runs slow, work skipped while measured, tokens
# counted that were never computed), never a speedup. The bandwidth is measured on the device
# (a large copy, timed with the clock captured before any candidate ran) and given SLACK
# headroom, so the bound never rejects honest work.

SPEED_OF_LIGHT_SLACK = 2.0
_BANDWIDTH: dict[str, float] = {}


def measure_bandwidth(device: Any, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second (read + written) of a copy larger than the last-level cache, the fastest
    of ``repeats``; measured once per device and remembered."""
    import torch

    from shapeshift.engine.verify import anticheat

    device = torch.device(device)
    key = str(device)
    if key in _BANDWIDTH and nbytes is None:
        return _BANDWIDTH[key]
    n = nbytes or ((1 << 30) if device.type == "cuda" else (128 << 20))
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    fastest = float("inf")
    for _ in range(repeats + 1):  # the fastest copy: what the device can do, not what a busy host gave
        anticheat.synchronize(device)
        t0 = anticheat.perf_counter()
        dst.copy_(src)
        anticheat.synchronize(device)
        fastest = min(fastest, anticheat.perf_counter() - t0)
    bandwidth = 2 * n / max(fastest, 1e-9)
    if nbytes is None:
        _BANDWIDTH[key] = bandwidth
    return bandwidth


def measured_speed_possible(output_tokens_per_s: float, model_config: Any, weights: dict[str, Any], dtype: Any,
                            batch_size: int, context_len: int, bandwidth_bytes_per_s: float,
                            device: Any = "cpu", slack: float = SPEED_OF_LIGHT_SLACK,
                            cache_bytes: float | None = None) -> dict[str, Any]:
    """Is a measured decode rate (output tokens/s at ``batch_size`` sequences of about
    ``context_len`` tokens) within what the device allows? Evidence {ok, max_tokens_per_s, ...};
    ``reason`` when it is not. ``cache_bytes``: a step whose bytes fit in this much cache is held
    to the FLOPs bound alone (default: the GPU's last-level cache; 32 MB on the host, whose
    gate-time spec assumes 1 GB to stay generous without a measured bandwidth)."""
    import torch

    from shapeshift.engine.verify.anticheat import HardwareSpec, decode_step_lower_bound_s, detect_hardware

    spec = detect_hardware(torch.device(device))
    if cache_bytes is None:
        cache_bytes = spec.cache_bytes if torch.device(device).type == "cuda" else 32e6
    hw = HardwareSpec(f"{spec.name}, measured bandwidth", slack * bandwidth_bytes_per_s,
                      {k: slack * v for k, v in spec.flops_per_s.items()}, cache_bytes)
    bound = decode_step_lower_bound_s(model_config, weights, dtype, batch_size, context_len, hw)
    limit = batch_size / bound["bound_s"] if bound["bound_s"] > 0 else float("inf")
    ok = output_tokens_per_s <= limit
    ev: dict[str, Any] = {"ok": ok, "output_tokens_per_s": output_tokens_per_s, "max_tokens_per_s": limit,
                          "batch_size": batch_size, "context_len": context_len,
                          "bandwidth_bytes_per_s": bandwidth_bytes_per_s, "slack": slack, **bound}
    if not ok:
        ev["reason"] = (f"measured {output_tokens_per_s:.1f} output tokens/s at batch {batch_size}, faster than the "
                        f"{limit:.1f} tokens/s the device allows ({bound['bytes'] / 1e6:.1f} MB a step at "
                        f"{slack:g} x the measured {bandwidth_bytes_per_s / 1e9:.1f} GB/s): a measurement fault")
    return ev


def check_measured_outputs(out: list[Any], tokens: dict[int, list[list[int]] | None],
                           dtype: Any = None) -> None:
    """One repeat's tokens against the reference's on the same requests: the last candidate of a
    pair is the incumbent (compare, screen_paired, compare_final), the others are checked against
    it, and a measured run whose outputs diverge is not a result (engine/verify/measured.py, at
    the prefix floor of the tier's `dtype`)."""
    ref = len(out) - 1
    if ref < 1 or tokens.get(ref) is None or out[ref].error is not None:
        return
    for i in range(ref):
        if out[i].error is None and tokens.get(i) is not None:
            ev = measured_outputs_agree(tokens[i], tokens[ref], dtype)
            out[i].details["measured_outputs"] = ev
            if not ev["ok"]:
                out[i].error = f"measured.outputs: {ev['reason']}"

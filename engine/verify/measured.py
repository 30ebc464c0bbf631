"""Check what was measured: the tokens a candidate produced in a measured replay against the
reference's on the same requests.

Verification alone is not enough: a pass can tell the gates from a measured replay (thread
names, call stacks, call counts) and be exact only while verified. The compile loop's paired
replays give both passes of a pair the same requests in the same repeat, so the incumbent's
tokens (the stock pass, or a champion verified and checked the same way) are the reference.

Data flow: ReplayRun.output_token_ids of candidate and reference, same requests, greedy
--measured_outputs_agree--> evidence {ok, requests, first_token_agreement, prefix_agreement, ...}.

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


def measured_outputs_agree(candidate: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
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
    ok = not lengths_differ and first_share >= MIN_FIRST_TOKEN_AGREEMENT and prefix_share >= MIN_PREFIX_AGREEMENT
    ev: dict[str, Any] = {"ok": ok, "requests": len(reference), "first_token_agreement": round(first_share, 4),
                          "prefix_agreement": round(prefix_share, 4), "min_first_token_agreement":
                          MIN_FIRST_TOKEN_AGREEMENT, "min_prefix_agreement": MIN_PREFIX_AGREEMENT}
    if lengths_differ:
        ev["output_lengths_differ"] = lengths_differ[:8]
    if not ok:
        ev["reason"] = ("measured outputs diverge from the reference's on the same requests "
                        f"(first tokens agree on {first_share:.0%}, token prefixes on {prefix_share:.0%})")
    return ev

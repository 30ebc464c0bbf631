"""The engine against Hugging Face transformers on random MoE checkpoints (top-k routing).

Mixtral (renormalized top-2 of 4 experts) and Qwen3-MoE (q/k norm, un-normalized top-2
of 6 experts, head_dim != hidden/heads). Prefill runs the sparse expert loop; decode
steps run the gather path (few tokens) or the dense all-experts path (many tokens), so
both static-shape decode variants are checked against HF as well.
"""

from __future__ import annotations

import pytest

from test_reference_llama import check_against_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_matches_hf(kind, tmp_path):
    check_against_hf(kind, tmp_path)


def test_moe_gather_decode_matches_hf(tmp_path):
    # A gather threshold above batch*top_k makes every decode step take the gather path.
    check_against_hf("mixtral", tmp_path, max_num_batched_tokens=8, max_num_seqs=4,
                     forward_pass_recipe={"moe_decode_gather_max_rows": 64})

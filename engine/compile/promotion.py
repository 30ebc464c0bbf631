"""Promotion check: the verification a confirmed winner must pass before it becomes the incumbent.

Data flow: the full-tier engine (weights, model config, dtype, device, block size) + the
candidate bundle --shapeshift.engine.verify.verify_candidate--> the engine's gate suite
(smoke, outputs.finite, outputs.agreement, KV contamination, coverage, anti-cheat), each on
fresh random prompts against the stock pass built over the same weights; the candidate runs in
a process of its own (engine/verify/isolated.py), the reference and the verdict in this one
--> Verification(passed, gates={name: passed}, report={the suite's report, its isolation; and
discard_engine, why, when the candidate left the engine's weights damaged beyond restoring}).

The compile loop owns no checks of its own: one suite decides, for the loop, the admin API
and the tests alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shapeshift.engine.compile.measure import Verification


def verify_for_promotion(engine: Any, candidate_path: Path, prompts: int = 4, steps: int = 16,
                         weights_baseline: Any = None, traffic_prompt_lens: tuple[int, ...] = ()) -> Verification:
    """``weights_baseline``: the engine weights' WeightsBaseline from before the candidate was
    first loaded (engine/forward_pass/weights_guard.py); None: taken at the start of verification.
    ``traffic_prompt_lens``: the replayed traffic's prompt lengths (p50, p90, p99), which the
    long-context gate decodes at besides the engine's limit."""
    from shapeshift.engine.verify import GateSettings, verify_candidate

    coverage = serving_coverage(engine.config)
    pool = getattr(getattr(engine, "block_manager", None), "num_blocks", 0)
    coverage["pool_blocks"] = int(pool or coverage["pool_blocks"])
    settings = GateSettings(num_prompts=prompts, steps=steps, block_size=engine.kv_cache.block_size,
                            **coverage, prompt_tokens=_replay_text(engine),
                            traffic_prompt_lens=tuple(traffic_prompt_lens))
    report = verify_candidate(candidate_path, engine.model_config, engine.weights, dtype=engine.dtype,
                              device=engine.device, settings=settings, weights_baseline=weights_baseline)
    gates = {g.name: bool(g.passed) for g in report.gates}
    verdict = Verification(passed=bool(report.passed) and bool(gates), gates=gates, report=report.to_dict())
    evidence = report.gate("anti_cheat.inputs_unchanged").evidence if "anti_cheat.inputs_unchanged" in gates else {}
    if evidence.get("discard_engine"):
        # Weights written and not restored (the loop's baseline keeps no copy; on CUDA the candidate's
        # process maps the engine's own tensors): the engine holding them must be discarded.
        verdict.passed, verdict.gates["anti_cheat.inputs_unchanged"] = False, False
        verdict.report["discard_engine"] = (f"the candidate changed the engine's weights ("
                                            f"{', '.join(evidence.get('not_restored', [])[:4])}) and they could "
                                            "not be restored; the engine is discarded")
    return verdict


def serving_coverage(cfg: Any) -> dict[str, Any]:
    """The GateSettings fields for the serving paths an EngineConfig takes: every decode batch
    size up to 16, every graph bucket up to its largest batch and the sizes between the buckets
    past 16 (GateSettings.decode_batch_sizes), contexts up to its max model length, a KV pool
    that holds its largest batch, and its configured pool (num_kv_blocks; verify_for_promotion
    puts the engine's own pool there) for coverage.block_pool."""
    buckets = tuple(b for b in (cfg.cuda_graph_batch_sizes or ()) if b <= cfg.max_num_seqs) + (cfg.max_num_seqs,)
    most = max((min(cfg.max_num_seqs, 16),) + buckets)
    return {"max_batch_size": min(cfg.max_num_seqs, 16), "graph_buckets": buckets,
            "max_model_len": cfg.max_model_len, "num_blocks": max(96, 3 * most + 8),
            "pool_blocks": int(cfg.num_kv_blocks or 0)}


def _replay_text(engine: Any) -> tuple[int, ...] | None:
    """The text the replays draw their prompts from (the engine's tokenizer over the replay
    corpus, EOS ids left out): the gates take fresh spans of it. None without a tokenizer."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return None
    from shapeshift.engine.replay.corpus import corpus_tokens

    eos = set(getattr(engine.model_config, "eos_token_ids", []) or [])
    eos |= set(getattr(tokenizer, "eos_token_ids", []) or [])
    try:
        tokens = corpus_tokens(tokenizer, eos, engine.model_config.vocab_size)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the corpus: random ids, as before
        return None
    return tuple(tokens) if len(tokens) >= 64 else None

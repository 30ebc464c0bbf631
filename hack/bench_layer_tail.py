"""Time the batch-1 layer tail (o_proj -> MLP -> next qkv) as one persistent kernel
(kernels/decode_layer_tail.py) against the four GEMV launches of the `fast` recipe, per layer,
on the Llama-3.2-1B shapes.

Data flow: 16 layers of random bf16 weights (1.94 GB, far past L2) -> one CUDA graph per
variant holding the 16 layers' launches in sequence, as a decode step has them, timed by
bench_kernels.time_graph (the median of 25 replays between CUDA events) -> us per layer and the
weight bytes streamed per us (GB/s) against the measured copy bandwidth. Variants: the separate GEMVs (the `fast` recipe's
kernels at their default tiles), then the persistent kernel at each (num_warps, tile elements,
programs per SM, programmatic dependent launch). With --layer-splits, the whole layer as well:
the `fast+fuse_rotary_into_attention` recipe's attention launch(es) followed by the tail,
against decode_layer (attention as the persistent kernel's phase 0) at each split count, over a
paged KV cache holding --context tokens per layer.
Prints a table and saves bench/results/layer-tail-<model>-<gpu>-<utc>.json (commit, GPU, command).

    python3 hack/bench_layer_tail.py [--warps 8,16] [--tiles 8192,16384,32768] [--programs 1,2]
                                       [--pdl off,on] [--split-barrier off,on] [--grid 256,264]
                                       [--early-tiles 0,1,2]
                                       [--layer-splits 1,2,4,8 --context 256] [--phases]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import measure_ceilings  # noqa: E402  (sibling script: the copy bandwidth it divides by)
from bench_kernels import time_graph  # noqa: E402  (sibling script: graph timing of the kernel benchmarks)
from benchmeta import REPO_ROOT, claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402  (sibling module)

HIDDEN, Q_DIM, INNER, NQKV, LAYERS = 2048, 2048, 8192, 3072, 16


def _graph_us(step) -> float:
    """us per call of `step()` (16 layers) replayed in a CUDA graph (bench_kernels.time_graph)."""
    return time_graph([step], quick=False)["median_us"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warps", default="4,8,16")
    parser.add_argument("--tiles", default="8192,16384", help="weight elements per row tile")
    parser.add_argument("--pdl", default="off", help="programmatic dependent launch of the layer tails: off, on")
    parser.add_argument("--programs", default="1,2", help="programs per SM (the barriers need them all resident)")
    parser.add_argument("--grid", default="", help="total programs to time instead of --programs (e.g. 256,264: "
                                                   "a grid dividing every phase's tile count leaves no short last round)")
    parser.add_argument("--split-barrier", default="on", help="off, on: arrive before the next phase's first "
                                                             "tile loads, wait after them")
    parser.add_argument("--early-tiles", default="2", help="of each weight's first two tiles of phases 2-4, how "
                        "many load before the barrier's wait (0, 1, 2; the rest after it)")
    parser.add_argument("--next-attention-splits", default="default",
                        help="split counts of the tail ending in the next layer's attention (--layer-splits), "
                             "e.g. default,1,4")
    parser.add_argument("--decode-layer", default="on", help="on, off: also time decode_layer (--layer-splits)")
    parser.add_argument("--layer-splits", default="",
                        help="attention splits of decode_layer to time (whole layer, attention first); empty: none")
    parser.add_argument("--context", type=int, default=256, help="tokens in each layer's KV cache (--layer-splits)")
    parser.add_argument("--phases", action="store_true",
                        help="also replay the default tail (and decode_layer at each --layer-splits, o_proj tiles "
                             "early and late) with per-phase GPU clock stamps and print where a layer's time goes")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from shapeshift.kernels.decode_layer_tail import decode_layer_tail
    from shapeshift.kernels.gemv import gemv, gemv_silu_and_mul

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dt)

    layers = [dict(o_proj=rand(HIDDEN, Q_DIM), post_norm=torch.ones(HIDDEN, device=dev, dtype=dt),
                   gate_up=rand(2 * INNER, HIDDEN), down_proj=rand(HIDDEN, INNER),
                   next_input_norm=torch.ones(HIDDEN, device=dev, dtype=dt), next_qkv=rand(NQKV, HIDDEN))
              for _ in range(LAYERS)]
    attn, residual = rand(1, Q_DIM), rand(1, HIDDEN)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    copy = measure_ceilings(dev)["copy_gbps"]

    def separate():
        for w in layers:
            y1 = gemv(attn, w["o_proj"])
            act, res2 = gemv_silu_and_mul(y1, w["gate_up"], norm_weight=w["post_norm"], eps=1e-5, residual=residual)
            y3 = gemv(act, w["down_proj"])
            gemv(y3, w["next_qkv"], norm_weight=w["next_input_norm"], eps=1e-5, residual=res2)

    rows = []

    def record(name, us_per_step, **extra):
        per_layer = us_per_step / LAYERS
        gbps = layer_bytes / (per_layer * 1e-6) / 1e9
        rows.append(dict(variant=name, us_per_layer=per_layer, gbps=gbps, share_of_copy=gbps / copy, **extra))
        print(f"{name:<62} {per_layer:8.2f} us/layer {gbps:8.0f} GB/s {gbps / copy:6.1%} of copy", flush=True)

    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; {layer_bytes / 1e6:.1f} MB of weights per layer")
    record("separate GEMVs (fast recipe)", _graph_us(separate))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    totals = ([(int(g), f"{int(g)} programs") for g in args.grid.split(",")] if args.grid else
              [(int(p) * sms, f"{int(p)}/SM") for p in args.programs.split(",")])
    grid = [(int(w), int(t), programs, label, pdl, split, int(early)) for w in args.warps.split(",")
            for t in args.tiles.split(",") for programs, label in totals for pdl in args.pdl.split(",")
            for split in args.split_barrier.split(",") for early in args.early_tiles.split(",")]
    # Variants whose programs do not all fit on the SMs at once are refused by the launcher (the
    # grid barrier would wait forever) and reported as failed below.
    for warps, tile, programs, label, pdl, split, early in grid:
        name = f"layer tail, {warps} warps, {tile}/tile, {label}, PDL {pdl}, split barrier {split}, early tiles {early}"
        os.environ["SHAPESHIFT_PDL"] = "layer_tail" if pdl == "on" else "0"

        def fused(warps=warps, tile=tile, programs=programs, split=split, early=early, stamps=None):
            for i, w in enumerate(layers):
                decode_layer_tail(attn, residual, eps=1e-5, num_warps=warps, tile_elements=tile, programs=programs,
                                  split_barrier=split == "on", timestamps=None if stamps is None else stamps[i],
                                  early_tiles=early, **w)
        try:
            record(name, _graph_us(fused), num_warps=warps, tile_elements=tile, programs=programs,
                   pdl=pdl, split_barrier=split, early_tiles=early)
            if args.phases and pdl == "off":
                rows.append(_phases(name, lambda stamps, fused=fused: fused(stamps=stamps)))
        except Exception as exc:  # a variant that does not compile (registers, layout): report, go on
            print(f"{name}: failed: {exc}", flush=True)
            rows.append(dict(variant=name, error=str(exc)[:500]))
    if args.layer_splits:
        _whole_layers(args, layers, residual, record, rows, rand, dev, dt)
    result = dict(benchmark="layer-tail", git_commit=git_commit(), gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, command=" ".join([sys.executable, *sys.argv]),
                  utc=_dt.datetime.now(_dt.timezone.utc).isoformat(), copy_gbps=copy, layer_weight_bytes=layer_bytes,
                  layers=LAYERS, timing="bench_kernels.time_graph median", context=args.context if args.layer_splits else None,
                  rows=rows)
    out = Path(args.out_dir)
    name = result_name("layer-tail", "llama-3.2-1b-shape", hardware_slug(result["gpu"]))
    path = out / (claim_result_name(out, name) + ".json")
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return 0


def _whole_layers(args, layers, residual, record, rows, rand, dev, dt) -> None:
    """Attention + tail per layer: the fused-rotary attention launch(es) then decode_layer_tail
    (the recipe's two kernels a layer), against decode_layer at each split count."""
    from shapeshift.kernels.decode_attention import decode_attention_rope
    from shapeshift.kernels.decode_layer_tail import NextAttention, decode_layer, decode_layer_tail
    from shapeshift.kernels.rotary import rope_cos_sin_cache

    heads, kv_heads, head_dim, block = Q_DIM // 64, 8, 64, 16
    blocks = -(-args.context // block) + 1
    caches = [(torch.randn(blocks, block, kv_heads, head_dim, device=dev, dtype=dt),
               torch.randn(blocks, block, kv_heads, head_dim, device=dev, dtype=dt)) for _ in range(LAYERS)]
    step = dict(positions=torch.tensor([args.context - 1], device=dev),
                cos_sin_cache=rope_cos_sin_cache(head_dim, 8192, 5e5, device=dev),
                slot_mapping=torch.tensor([args.context - 1], device=dev),
                block_tables=torch.arange(blocks, device=dev, dtype=torch.int32).view(1, -1),
                context_lens=torch.tensor([args.context], device=dev, dtype=torch.int32), scale=head_dim ** -0.5)
    qkv, attn_in = rand(1, NQKV), rand(1, Q_DIM)
    q, k, v = (t.view(1, -1, head_dim) for t in qkv.split([Q_DIM, kv_heads * head_dim, kv_heads * head_dim], -1))

    def separate(stamps=None, attention_stamps=None):
        for i, (w, (kc, vc)) in enumerate(zip(layers, caches)):
            o = decode_attention_rope(q, k, v, step["positions"], step["cos_sin_cache"], step["slot_mapping"], kc, vc,
                                      step["block_tables"], step["context_lens"], step["scale"],
                                      timestamps=None if attention_stamps is None else attention_stamps[i])
            decode_layer_tail(o.view(1, -1), residual, eps=1e-5, timestamps=None if stamps is None else stamps[i], **w)

    os.environ["SHAPESHIFT_PDL"] = "0"
    name = f"attention (rope fused) + layer tail, {args.context} tokens"
    record(name, _graph_us(separate), context=args.context)
    if args.phases:  # the tail's phases between attention launches, and the launches themselves
        rows.append(_phases(name, lambda stamps: separate(stamps=stamps)))
        try:
            rows.append(_attention_timeline(name, separate))
        except Exception as exc:  # report, go on
            print(f"{name}, attention stamps: failed: {exc}", flush=True)
            rows.append(dict(variant=name + ", attention launch", error=str(exc)[:500]))
    for pdl, splits in ((p, n) for p in args.pdl.split(",") for n in args.next_attention_splits.split(",")):
        os.environ["SHAPESHIFT_PDL"] = "layer_tail" if pdl == "on" else "0"  # each tail ends in the next attention
        count = None if splits == "default" else int(splits)

        def into_tail(stamps=None, count=count):
            for i, w in enumerate(layers):
                kc, vc = caches[(i + 1) % LAYERS]
                decode_layer_tail(attn_in, residual, eps=1e-5, **w, timestamps=None if stamps is None else stamps[i],
                                  next_attention=NextAttention(**step, k_cache=kc, v_cache=vc, splits=count))
        name = (f"layer tail + the next layer's attention (phase 5), {splits} splits, PDL {pdl}, "
                f"{args.context} tokens")
        try:
            record(name, _graph_us(into_tail), context=args.context, pdl=pdl, next_attention_splits=splits)
            if args.phases and pdl == "off":
                rows.append(_phases(name, lambda stamps: into_tail(stamps=stamps)))
        except Exception as exc:  # report, go on
            print(f"{name}: failed: {exc}", flush=True)
            rows.append(dict(variant=name, error=str(exc)[:500]))
    os.environ["SHAPESHIFT_PDL"] = "0"
    splits_list = [int(x) for x in args.layer_splits.split(",")] if args.decode_layer == "on" else []
    for splits, early, split in ((n, e, b) for n in splits_list for e in (True, False)
                                 for b in args.split_barrier.split(",")):
        def whole(splits=splits, early=early, split=split, stamps=None):
            for i, (w, (kc, vc)) in enumerate(zip(layers, caches)):
                decode_layer(qkv, residual, eps=1e-5, **w, **step, k_cache=kc, v_cache=vc, attention_splits=splits,
                             early_o_proj_tiles=early, split_barrier=split == "on",
                             timestamps=None if stamps is None else stamps[i])
        name = (f"decode_layer (attention phase 0), {splits} splits, o_proj tiles {'early' if early else 'late'}, "
                f"split barrier {split}, {args.context} tokens")
        try:
            record(name, _graph_us(whole), context=args.context, attention_splits=splits,
                   early_o_proj_tiles=early, split_barrier=split)
            if args.phases:
                rows.append(_phases(name, lambda stamps, whole=whole: whole(stamps=stamps)))
        except Exception as exc:  # report, go on
            print(f"{name}: failed: {exc}", flush=True)
            rows.append(dict(variant=name, error=str(exc)[:500]))


PHASES = ("attention", "o_proj", "gate/up", "down", "next qkv", "next attention")
PHASE_BYTES = {1: HIDDEN * Q_DIM * 2, 2: 2 * INNER * HIDDEN * 2, 3: HIDDEN * INNER * 2, 4: NQKV * HIDDEN * 2}


def _phases(name, step) -> dict:
    """Replay `step(stamps)` (16 layers, each writing its programs' GPU clock stamps) in a graph and
    print, averaged over the layers, when each phase begins (median program) and ends (last
    program) from the kernel's start, its work time per program (median, max), the barrier's
    latency (last arrival to median exit) and the phase's weight stream rate (GB/s)."""
    from shapeshift.kernels.decode_layer_tail import STAMP_SLOTS

    stamps = [torch.zeros((1024, STAMP_SLOTS), dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    _graph_us(lambda: step(stamps))  # the last replay's stamps stay
    ran = [t[t[:, 0] > 0].cpu() for t in stamps]  # per layer, the rows of programs that ran
    table = {}
    for t in ran:
        t = t.double() / 1e3  # us
        t0 = t[:, 0].min()
        for p in range(len(PHASES)):
            begin, end = (t[:, 0], t[:, 1]) if p == 0 else (t[:, 2 * p], t[:, 2 * p + 1])
            if (end == 0).all():
                continue
            if p == 5:  # only the attention items' programs run the next layer's attention
                begin, end = begin[end > 0], end[end > 0]
            row = table.setdefault(p, {"begin": [], "end": [], "work_med": [], "work_max": [], "barrier": []})
            row["begin"].append(float(begin.median() - t0))
            row["end"].append(float(end.max() - t0))
            row["work_med"].append(float((end - begin).median()))
            row["work_max"].append(float((end - begin).max()))
            prev = 2 * p - 1 if p > 1 else 1
            if p > 0 and (t[:, prev] > 0).all():  # a barrier ends the previous phase in this launch
                row["barrier"].append(float(begin.median() - t[:, prev].max()))
    mean = {PHASES[p]: {k: (sum(v) / len(v) if v else None) for k, v in row.items()} for p, row in table.items()}
    per_sm = _gate_up_by_sm(ran)
    print(f"-- {name}: per phase, us from the kernel's start (mean of {LAYERS} layers)")
    for p, (phase, row) in enumerate((PHASES[p], mean[PHASES[p]]) for p in sorted(table)):
        rate = ""
        p_index = PHASES.index(phase)
        if p_index in PHASE_BYTES:
            gbps = PHASE_BYTES[p_index] / ((row["end"] - row["begin"]) * 1e-6) / 1e9
            row["gbps"] = gbps
            rate = f"{gbps:6.0f} GB/s"
        barrier = f"barrier {row['barrier']:5.2f}" if row["barrier"] is not None else " " * 13
        print(f"   {phase:<9} begins {row['begin']:6.2f} ends {row['end']:6.2f}  work med {row['work_med']:6.2f} "
              f"max {row['work_max']:6.2f}  {barrier}  {rate}", flush=True)
    if per_sm:
        print(f"   gate/up by SM: slowest SM {per_sm['slowest_minus_median_us']:.2f} us behind the median SM's mean "
              f"work; layers 0-7 against 8-15, correlation of each SM's mean work {per_sm['half_correlation']:.2f}; "
              f"slowest SMs {per_sm['slowest_sms']}", flush=True)
    return dict(variant=name, phases=mean, gate_up_by_sm=per_sm)


def _attention_timeline(name, separate) -> dict:
    """Replay 16 x (attention launch, layer tail) with both kernels' clock stamps and print, as
    means over the layers (us): the gap from the tail before (its last program's last stamp) to
    the attention's first program, the spread of its programs' starts, their work to the split's
    partial stored (median, max), the merge after it (the merging programs' extra time), the
    attention's span, and the gap from its last program to the next tail's first."""
    from shapeshift.kernels.triton_helpers import SM_SLOT, STAMP_SLOTS

    tails = [torch.zeros((1024, STAMP_SLOTS), dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    attention = [torch.zeros((1024, STAMP_SLOTS), dtype=torch.int64, device="cuda") for _ in range(LAYERS)]
    _graph_us(lambda: separate(stamps=tails, attention_stamps=attention))
    tails = [t[t[:, 0] > 0].cpu().double() / 1e3 for t in tails]
    attention = [t[t[:, 0] > 0].cpu().double() / 1e3 for t in attention]
    rows = {k: [] for k in ("gap_before", "start_spread", "attend_med", "attend_max", "merge", "span", "gap_after")}
    for i in range(1, LAYERS):  # layer i's attention sits between tail i-1 and tail i
        a, before, after = attention[i], tails[i - 1], tails[i]
        start, stored, end = a[:, 0], a[:, 1], a[:, 2]
        rows["gap_before"].append(float(start.min() - before[:, 1:SM_SLOT].max()))
        rows["start_spread"].append(float(start.median() - start.min()))
        rows["attend_med"].append(float((stored - start).median()))
        rows["attend_max"].append(float((stored - start).max()))
        rows["merge"].append(float((end - stored).max()))
        rows["span"].append(float(end.max() - start.min()))
        rows["gap_after"].append(float(after[:, 0].min() - end.max()))
    mean = {k: sum(v) / len(v) for k, v in rows.items()}
    print(f"-- {name}: the attention launch between two tails, us (mean of {LAYERS - 1} layers)\n"
          f"   gap after the tail {mean['gap_before']:5.2f}  starts spread {mean['start_spread']:5.2f}  "
          f"to the partial stored med {mean['attend_med']:5.2f} max {mean['attend_max']:5.2f}  "
          f"merge {mean['merge']:5.2f}  span {mean['span']:5.2f}  gap to the next tail {mean['gap_after']:5.2f}",
          flush=True)
    return dict(variant=name + ", attention launch", attention_timeline=mean)


def _gate_up_by_sm(ran) -> dict | None:
    """Whether the gate/up stragglers sit on the same SMs (``ran``: each layer's stamps of the
    programs that ran, on the host): each SM's mean gate/up work (its programs, over the
    layers), the slowest SM against the median one, and the correlation of the per-SM means of
    the first half of the layers with the second half's (near 1: the same SMs are slow every
    layer; near 0: a different straggler each time)."""
    from shapeshift.kernels.decode_layer_tail import SM_SLOT

    halves = [{}, {}]
    for i, t in enumerate(ran):
        work = (t[:, 5] - t[:, 4]).double() / 1e3  # us, gate/up (phase 2: slots 4, 5)
        for sm, w in zip(t[:, SM_SLOT].tolist(), work.tolist()):
            halves[i * 2 // len(ran)].setdefault(sm, []).append(w)
    common = sorted(set(halves[0]) & set(halves[1]))
    if len(common) < 3:
        return None
    a = torch.tensor([sum(halves[0][sm]) / len(halves[0][sm]) for sm in common], dtype=torch.float64)
    b = torch.tensor([sum(halves[1][sm]) / len(halves[1][sm]) for sm in common], dtype=torch.float64)
    both = (a + b) / 2
    order = torch.argsort(both, descending=True)
    return {"sms": len(common), "slowest_minus_median_us": float(both.max() - both.median()),
            "half_correlation": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
            "slowest_sms": [common[i] for i in order[:8].tolist()],
            "mean_work_us_by_sm": {sm: float(w) for sm, w in zip(common, both.tolist())}}


if __name__ == "__main__":
    sys.exit(main())

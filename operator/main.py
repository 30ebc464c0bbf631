"""`shapeshift operator`: run the kopf operator with Shapeshift's handlers.

    argv -> argparse -> environment (resync interval) -> import handlers (registers them)
         -> kopf.run(namespaces | clusterwide, standalone, liveness endpoint)

Usage:
    shapeshift operator --namespace NS [--namespace NS2 ...] [--standalone]
    shapeshift operator --all-namespaces [--standalone]

`--standalone` skips kopf's peering (one operator replica; no kopf.dev peering
CRDs needed). Without it, replicas coordinate through KopfPeering /
ClusterKopfPeering objects, whose CRDs must then be installed
(crds/kopf.dev_peerings.yaml) along with the peering object itself: the live
replica with the highest `--priority` acts, the others pause their handlers,
timers and the drift scheduler until its keep-alive (`--peering-lifetime`)
lapses. The liveness
endpoint (default http://0.0.0.0:8080/healthz) answers 200 while the operator's
watch loops run; point the pod's livenessProbe at it.

The operator reaches the API server through the pod's ServiceAccount in a
cluster, and through $KUBECONFIG elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shapeshift operator",
        description="Run the Shapeshift Kubernetes operator (InferenceDeployment, CompileRun, ForwardPass).",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--standalone", action="store_true",
                        help="run without peering (a single replica; kopf peering CRDs not needed)")
    parser.add_argument("--peering", default="shapeshift", metavar="NAME",
                        help="peering object name when not standalone (default: %(default)s)")
    parser.add_argument("--priority", type=int, default=None, metavar="N",
                        help="peering priority: the live replica with the highest one acts, the others pause"
                             " (default: random, so that replicas of one Deployment differ)")
    parser.add_argument("--peering-lifetime", type=int, default=30, metavar="S",
                        help="seconds a replica's peering keep-alive stays valid: a killed leader's successor"
                             " resumes within about this long (default: %(default)s)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                        help="health endpoint to serve (default: %(default)s; 'none' disables it)")
    parser.add_argument("--resync-seconds", type=float, default=None, metavar="S",
                        help="how often timers re-read what is running (default: $SHAPESHIFT_RESYNC_SECONDS or 10)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.resync_seconds is not None:
        if args.resync_seconds <= 0:
            print("shapeshift operator: --resync-seconds must be > 0", file=sys.stderr)
            return 2
        # read once, by operator/settings.py, when the handlers are imported (kopf fixes timer intervals then)
        os.environ["SHAPESHIFT_RESYNC_SECONDS"] = str(args.resync_seconds)

    import kopf

    from shapeshift.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, quiet=args.quiet)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    liveness = None if args.liveness.lower() == "none" else args.liveness
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    # Equal priorities pause every replica (kopf cannot tell which one should act), hence random.
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    try:
        kopf.run(
            settings=settings,
            standalone=args.standalone,
            priority=priority,
            # kopf makes peering mandatory whenever a name is given, overriding standalone.
            peering_name=None if args.standalone else args.peering,
            clusterwide=bool(args.all_namespaces),
            namespaces=args.namespaces or (),
            liveness_endpoint=liveness,
        )
    except KeyboardInterrupt:
        pass
    except asyncio.CancelledError:
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover - the console script is `shapeshift operator`
    sys.exit(main())

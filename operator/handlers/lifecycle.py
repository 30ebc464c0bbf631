"""Operator lifecycle handlers: kopf's settings at startup, and how it logs in to the API server."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from shapeshift.operator.api import GROUP
from shapeshift.operator.settings import OperatorSettings


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (status is schema-checked and ours), post INFO+ events,
    run handlers on SHAPESHIFT_HANDLER_WORKERS threads."""
    del memo  # the API client is created lazily by kube_of()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    settings.execution.max_workers = OperatorSettings.from_environ().handler_workers


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the ServiceAccount. Elsewhere: $KUBECONFIG as it is now (the client
    library's own auto-login reads $KUBECONFIG once, when it is first imported)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)

"""How failures inside a handler become kopf's retry decisions.

    ApiException 409, 429, 5xx  --api_errors-->   kopf.TemporaryError (retried in 5 s)
    API server unreachable      --api_errors-->   kopf.TemporaryError (retried in 2 s; one log line,
                                                  not the connection's traceback)
    a spec the models reject    --parse_or_fail--> status phase Failed + Ready False, kopf.PermanentError
    any other ApiException      --api_message-->  the API server's message, for a condition
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import kopf
import urllib3
from kubernetes.client import ApiException
from pydantic import ValidationError

from shapeshift.operator.api import Kind, parse_spec, short_error
from shapeshift.operator.kube import Kube
from shapeshift.operator.status import StatusUpdate

T = TypeVar("T")

RECONNECT_DELAY_S = 2.0  # an unreachable API server (restarting, a network blip): soon, and often


def api_errors(call: Callable[[], T], retry_s: float | None = None) -> T:
    """Turn retryable API errors into kopf.TemporaryError (conflicts, throttling, server errors,
    an API server that cannot be reached); ``retry_s`` (a timer's own interval) replaces both
    delays."""
    try:
        return call()
    except ApiException as error:
        if error.status in (409, 429) or (error.status or 0) >= 500:
            raise kopf.TemporaryError(f"API server answered {error.status} {error.reason}; retrying",
                                      delay=retry_s or 5)
        raise
    except UNREACHABLE as error:
        raise kopf.TemporaryError(f"{unreachable(error)}; retrying", delay=retry_s or RECONNECT_DELAY_S) from None


UNREACHABLE = (urllib3.exceptions.HTTPError, ConnectionError)  # what the client raises with no API server


def unreachable(error: BaseException) -> str:
    """One line for an error in UNREACHABLE, naming its cause (not its traceback)."""
    reason = getattr(error, "reason", None) or error
    return f"API server unreachable ({type(reason).__name__})"


def api_message(error: ApiException) -> str:
    """The API server's own message of a refusal (its Status body), else status and reason."""
    try:
        message = json.loads(error.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return message or f"{error.status} {error.reason}"


def parse_or_fail(kind: Kind, spec: Any, body: kopf.Body, kube: Kube) -> Any:
    """The typed spec; an invalid one is reported in the status and never retried."""
    try:
        return parse_spec(kind, spec)
    except ValidationError as error:
        message = f"invalid spec: {short_error(error)}"
        kube.write_status(kind, body["metadata"]["namespace"], body["metadata"]["name"],
                          StatusUpdate({"phase": "Failed", "message": message},
                                       [("Ready", "False", "InvalidSpec", message)]))
        raise kopf.PermanentError(f"{kind.kind} {body['metadata']['name']}: {message}")

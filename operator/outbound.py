"""Where the operator may connect: its outbound policy for Prometheus and the LLM agents' endpoints.

    spec.prometheusUrl / SHAPESHIFT_PROMETHEUS_URL, spec.agents[].llm.endpoint
        --outbound_problem(url, allowed_cidrs)--> None, or why the operator will not connect there

The API server already refused anything but http(s)://host[:port][/path] (operator/api/common.py
outbound_url_rule). At use, before any connection: the host's addresses (a literal IP, or what the
resolver returns) must not be link-local (169.254.0.0/16, fe80::/10: cloud metadata services
live there) or another cloud's metadata address, unless an operator-wide setting allows a CIDR
(SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS). A host that does not resolve is left to the connection to
report. Messages quote the host, never the URL's path or anything a server answered.

What it cannot cover: a name that resolves to an allowed address now and to a metadata address
at connect time (DNS rebinding); pin Prometheus by IP or by a cluster Service name to close that.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

__all__ = ["BLOCKED_NETWORKS", "OutboundRefused", "host_of", "outbound_problem"]

BLOCKED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16",  # IPv4 link-local: AWS, GCP, Azure, OpenStack metadata at 169.254.169.254
    "fe80::/10",  # IPv6 link-local
    "fd00:ec2::254/128",  # AWS metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
))


class OutboundRefused(ValueError):
    """The policy refuses the address (before any connection)."""


def host_of(url: str) -> str:
    """The URL's host and port (no userinfo, path or query), for messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "(no host)"
    host = f"[{host}]" if ":" in host else host
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{host}:{port}" if port else host


def _addresses(host: str, port: int | None) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port or 80, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []  # the connection will say it does not resolve
    return [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]


def outbound_problem(url: str, allowed_cidrs: tuple[str, ...] = (), *, what: str = "the URL") -> str | None:
    """Why the operator will not connect to `url` (None: it may). `what` names the setting in the
    message (e.g. "spec.prometheusUrl")."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        return f"{what}: only http(s)://host URLs are used (host {host or '(none)'})"
    if parts.username is not None or parts.password is not None:
        return f"{what}: a URL with user:password@ is not used (host {host}); put credentials in a Secret"
    allowed = tuple(ipaddress.ip_network(c, strict=False) for c in allowed_cidrs)
    for address in _addresses(host, parts.port):
        mapped = getattr(address, "ipv4_mapped", None) or address
        if any(mapped in net for net in allowed):
            continue
        if any(mapped.version == net.version and mapped in net for net in BLOCKED_NETWORKS):
            return (f"{what}: host {host} is {mapped}, a link-local or cloud metadata address; the operator does "
                    "not connect there unless the operator setting SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS "
                    "(chart value outbound.allowedCidrs) allows it")
    return None

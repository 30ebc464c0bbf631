"""The rollout contract between the operator and the engine in each pod (no torch, no HTTP).

Data flow of a rollout:

    operator --patches pod annotations--> pod metadata
      --kubelet, downwardAPI volume--> /etc/shapeshift/podinfo/annotations (key="value" lines)
      --engine's RolloutAgent (engine/rollout/agent.py) polls and parses it-->
        DesiredForwardPass(name, sha256, artifact)
      --fetch artifact, check sha256, hot reload--> the engine reports what it runs:
        shapeshift_forward_pass_info{name, sha256}          (what is active)
        shapeshift_forward_pass_reloads_total{result}       (every attempt, by outcome)
        shapeshift_forward_pass_last_reload_status{result}  (1 on the last attempt's outcome)
        shapeshift_forward_pass_in_sync                     (1 when active == desired)

All three annotations absent or empty means the stock forward pass. Rolling back is
writing the annotations of the previous pass (or removing them for stock); the engine
re-activates a pass it still holds in memory without fetching it again.

Everything here is importable by the operator without the engine's dependencies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ------------------------------------------------------------------ annotation keys

ANNOTATION_PREFIX = "shapeshift.dev/"
# Name of the ForwardPass resource the pod should run ("" or absent: stock).
ANNOTATION_FORWARD_PASS = "shapeshift.dev/forward-pass"
# Bundle digest (manifest digest, 64 lowercase hex) the fetched artifact must have.
ANNOTATION_FORWARD_PASS_SHA256 = "shapeshift.dev/forward-pass-sha256"
# Where the bundle is: an absolute path on a shared volume (folder or .tar.gz),
# file:///path, or an http(s):// URL of a .tar.gz.
ANNOTATION_FORWARD_PASS_ARTIFACT = "shapeshift.dev/forward-pass-artifact"
ROLLOUT_ANNOTATIONS = (ANNOTATION_FORWARD_PASS, ANNOTATION_FORWARD_PASS_SHA256, ANNOTATION_FORWARD_PASS_ARTIFACT)

STOCK_FORWARD_PASS = "stock"
# Where the engine container sees the pod's annotations (downwardAPI volume item
# `annotations` with fieldRef metadata.annotations, mounted at /etc/shapeshift/podinfo).
DEFAULT_ANNOTATIONS_FILE = "/etc/shapeshift/podinfo/annotations"
DOWNWARD_API_MOUNT_PATH = "/etc/shapeshift/podinfo"
DOWNWARD_API_ANNOTATIONS_ITEM = "annotations"



def podinfo_volume(name: str = "podinfo") -> dict:
    """The pod-template volume that exposes the pod's annotations to the engine container."""
    return {"name": name, "downwardAPI": {"items": [
        {"path": DOWNWARD_API_ANNOTATIONS_ITEM, "fieldRef": {"fieldPath": "metadata.annotations"}}]}}


def podinfo_volume_mount(name: str = "podinfo") -> dict:
    """The engine container's mount of ``podinfo_volume``; pair it with the server flag
    ``--desired-forward-pass-file`` + DEFAULT_ANNOTATIONS_FILE."""
    return {"name": name, "mountPath": DOWNWARD_API_MOUNT_PATH, "readOnly": True}


def serve_args(annotations_file: str = DEFAULT_ANNOTATIONS_FILE) -> list[str]:
    """`shapeshift serve` arguments that make the engine follow the annotations."""
    return ["--desired-forward-pass-file", annotations_file]


# ------------------------------------------------------------------ reload outcomes
# Values of the `result` label of the forward-pass reload series (series names:
# engine/contracts/metric_names.py).

RESULT_SUCCESS = "success"  # the desired pass is active (loaded or re-activated)
RESULT_DIGEST_MISMATCH = "digest_mismatch"  # the artifact's digest is not the annotation's sha256
RESULT_FETCH_ERROR = "fetch_error"  # the artifact could not be fetched (missing, HTTP error, timeout, too large)
RESULT_REFUSED = "refused"  # the bundle or the annotations are invalid, or the pass failed import/build/smoke
RESULT_UNREADABLE = "unreadable"  # the artifact is there, but the engine's user may not read it (file modes)
RELOAD_RESULTS = (RESULT_SUCCESS, RESULT_DIGEST_MISMATCH, RESULT_FETCH_ERROR, RESULT_REFUSED, RESULT_UNREADABLE)

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def is_sha256(text: str) -> bool:
    return bool(_SHA256_RE.match(text))


@dataclass(frozen=True)
class DesiredForwardPass:
    """What the annotations ask a pod to run. All empty: the stock pass."""

    name: str = ""
    sha256: str = ""
    artifact: str = ""

    @property
    def is_stock(self) -> bool:
        """No pass named, or `stock` named without a digest or artifact to pin another bundle."""
        return (not self.name and not self.sha256 and not self.artifact) or (
            self.name == STOCK_FORWARD_PASS and not self.sha256 and not self.artifact)

    @classmethod
    def from_annotations(cls, annotations: dict[str, str]) -> "DesiredForwardPass":
        return cls(name=(annotations.get(ANNOTATION_FORWARD_PASS) or "").strip(),
                   sha256=(annotations.get(ANNOTATION_FORWARD_PASS_SHA256) or "").strip().lower(),
                   artifact=(annotations.get(ANNOTATION_FORWARD_PASS_ARTIFACT) or "").strip())

    def to_annotations(self) -> dict[str, str]:
        """The annotations that ask for this pass (an empty dict for stock)."""
        if self.is_stock:
            return {}
        return {ANNOTATION_FORWARD_PASS: self.name, ANNOTATION_FORWARD_PASS_SHA256: self.sha256,
                ANNOTATION_FORWARD_PASS_ARTIFACT: self.artifact}

    def problems(self) -> list[str]:
        """Why this request cannot be acted on (empty when it can)."""
        if self.is_stock:
            return []
        out = []
        if not self.sha256:
            out.append(f"annotation {ANNOTATION_FORWARD_PASS_SHA256} is missing; the engine loads only a "
                       "bundle whose digest it can check")
        elif not is_sha256(self.sha256):
            out.append(f"annotation {ANNOTATION_FORWARD_PASS_SHA256}={self.sha256!r} is not 64 hex digits")
        return out

    def describe(self) -> str:
        if self.is_stock:
            return STOCK_FORWARD_PASS
        return f"{self.name or '(unnamed)'} sha256={self.sha256[:12] or '(none)'} from {self.artifact or '(no artifact)'}"


# ------------------------------------------------------------------ downwardAPI file format
# The kubelet writes a map as sorted `key="value"` lines, the value quoted like Go's
# strconv.Quote (%q): backslash escapes for quotes, backslashes, control characters
# (\n, \t, \xNN, \uNNNN, \UNNNNNNNN) and bytes of invalid UTF-8 (\xNN).

_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "\\": "\\", '"': '"', "'": "'"}


class DownwardAPIFormatError(ValueError):
    """A line of a downwardAPI map file is not `key="quoted value"`."""


def _unquote_go(quoted: str, where: str) -> str:
    if len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
        raise DownwardAPIFormatError(f"{where}: value {quoted!r} is not a double-quoted string")
    body = quoted[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            raise DownwardAPIFormatError(f"{where}: unescaped quote inside the value")
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        if i + 1 >= len(body):
            raise DownwardAPIFormatError(f"{where}: value ends with a lone backslash")
        esc = body[i + 1]
        if esc in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[esc].encode("utf-8")
            i += 2
        elif esc in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[esc]
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise DownwardAPIFormatError(f"{where}: bad \\{esc} escape {body[i:i + 2 + width]!r}")
            value = int(digits, 16)
            if esc == "x":  # a raw byte (possibly part of invalid UTF-8)
                out.append(value)
            else:
                try:
                    out += chr(value).encode("utf-8")
                except (ValueError, UnicodeEncodeError) as exc:
                    raise DownwardAPIFormatError(f"{where}: bad code point in {body[i:i + 2 + width]!r}") from exc
            i += 2 + width
        elif esc in "01234567":
            digits = body[i + 1:i + 4]
            if len(digits) != 3 or not all(c in "01234567" for c in digits) or int(digits, 8) > 255:
                raise DownwardAPIFormatError(f"{where}: bad octal escape {body[i:i + 4]!r}")
            out.append(int(digits, 8))
            i += 4
        else:
            raise DownwardAPIFormatError(f"{where}: unknown escape \\{esc}")
    return out.decode("utf-8", errors="replace")


def parse_downward_api_map(text: str, source: str = "annotations") -> dict[str, str]:
    """`key="value"` lines (the kubelet's format for labels/annotations) -> dict.

    Blank lines are skipped; any other malformed line raises DownwardAPIFormatError
    naming the line, so a half-written or foreign file is never read as "stock".
    """
    result: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, rest = line.partition("=")
        where = f"{source}:{lineno}"
        if not sep or not key:
            raise DownwardAPIFormatError(f"{where}: expected key=\"value\", got {line[:80]!r}")
        result[key] = _unquote_go(rest, where)
    return result


def _quote_go(value: str) -> str:
    out = ['"']
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in "\a\b\f\n\r\t\v":
            out.append({"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t",
                        "\v": r"\v"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        elif not ch.isprintable():
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def format_downward_api_map(annotations: dict[str, str]) -> str:
    """The text the kubelet would write for ``annotations`` (sorted keys, Go-quoted values)."""
    return "\n".join(f"{key}={_quote_go(annotations[key])}" for key in sorted(annotations))

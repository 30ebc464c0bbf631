"""Traffic of changing shape against an InferenceDeployment's engines, and a recording of what happened.

    RegimeLoad({pod: base URL}, shape)   one coordinator thread per engine: each round sends
        `shape.burst` greedy completions at once (token-id prompts of random tokens, so no two
        share a prefix), waits for all of them, then pauses `shape.gap_s`; `set(shape)` changes the
        traffic at the next round (a pause is cut short). Every request is kept: start, end, pod,
        HTTP status (-1: no answer), the shape it belonged to; `failures()` lists the ones that
        did not answer 200.
    Recorder(cluster, namespace, deployment, urls)   a thread sampling once a second what each
        engine's /metrics says it serves (shapeshift_forward_pass_info sha256), the deployment's
        rollout phase, current regime and Drifted reason, and every CompileRun's phase; `mark()`
        adds the test's own stage markers; `events()` reads the deployment's Kubernetes Events.
    timeline(load, recorder, ...) -> dict (JSON): requests/s and p90 latency per 5 s bucket, the
        sha256 each pod served over time, CompileRun phases, rollout phases, regimes, events and
        marks, times in seconds from the start of the load
    plot_timeline(timeline, path)   the same as a PNG (matplotlib, Agg)
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import kubernetes

from harness.engine_server import scrape

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
BUCKET_S = 5.0


@dataclass(frozen=True)
class Shape:
    """One kind of traffic: prompt lengths (inclusive range), answer length, requests sent at once
    per engine, and the pause between two such bursts."""

    name: str
    prompt: tuple[int, int]
    max_tokens: int
    burst: int = 1
    gap_s: float = 0.0

    def calmer(self, gap_s: float) -> "Shape":
        """The same traffic (lengths, burst) with longer pauses between bursts."""
        return Shape(f"{self.name} (calm)", self.prompt, self.max_tokens, self.burst, gap_s)


@dataclass(frozen=True)
class Request:
    start: float
    end: float
    pod: str
    status: int
    shape: str
    error: str = ""


class RegimeLoad:
    def __init__(self, urls: dict[str, str], shape: Shape, *, model: str, max_burst: int = 16,
                 timeout_s: float = 60.0, seed: int = 0):
        self.urls, self.model, self.timeout_s = dict(urls), model, timeout_s
        self.max_burst = max_burst
        self.shape = shape
        self.t0 = time.time()
        self.requests: list[Request] = []
        self.shapes: list[tuple[float, str]] = [(0.0, shape.name)]
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._engine, args=(pod, url), daemon=True, name=f"load-{pod}")
                         for pod, url in self.urls.items()]

    def set(self, shape: Shape) -> None:
        if shape.burst > self.max_burst:
            raise ValueError(f"burst {shape.burst} is more than the load's max_burst {self.max_burst}")
        with self._lock:
            self.shape = shape
            self.shapes.append((time.time() - self.t0, shape.name))
        self._changed.set()

    def _prompt(self, lengths: tuple[int, int]) -> list[int]:
        with self._lock:
            length = self._rng.randint(*lengths)
            return [self._rng.randrange(5, 500) for _ in range(length)]

    def _one(self, client: httpx.Client, pod: str, url: str, shape: Shape) -> None:
        prompt = self._prompt(shape.prompt)
        start = time.time()
        status, error = -1, ""
        try:
            r = client.post(f"{url}/v1/completions", json={"model": self.model, "prompt": prompt,
                                                           "max_tokens": shape.max_tokens, "temperature": 0})
            status = r.status_code
            if status != 200:
                error = r.text[:300]
        except httpx.HTTPError as exc:
            error = repr(exc)
        with self._lock:
            self.requests.append(Request(start - self.t0, time.time() - self.t0, pod, status, shape.name, error))

    def _engine(self, pod: str, url: str) -> None:
        limits = httpx.Limits(max_connections=self.max_burst, max_keepalive_connections=self.max_burst)
        with httpx.Client(timeout=self.timeout_s, limits=limits) as client, ThreadPoolExecutor(self.max_burst) as pool:
            while not self._stop.is_set():
                shape = self.shape
                wait([pool.submit(self._one, client, pod, url, shape) for _ in range(shape.burst)])
                if shape.gap_s > 0 and self.shape is shape:
                    self._changed.wait(shape.gap_s)
                    self._changed.clear()

    def failures(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.status != 200]

    def __enter__(self) -> "RegimeLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._changed.set()
        for t in self._threads:
            t.join(self.timeout_s)


class Recorder(threading.Thread):
    """Samples the engines and the cluster once a second (its own API client)."""

    def __init__(self, cluster, namespace: str, deployment: str, urls: dict[str, str], t0: float,
                 interval_s: float = 1.0):
        super().__init__(daemon=True, name="timeline-recorder")
        self.namespace, self.deployment, self.urls, self.t0, self.interval_s = namespace, deployment, dict(urls), t0, interval_s
        self.api = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.samples: list[dict[str, Any]] = []
        self.marks: list[tuple[float, str]] = []
        self._halt = threading.Event()

    def mark(self, text: str) -> None:
        self.marks.append((time.time() - self.t0, text))

    def sample(self) -> dict[str, Any]:
        shas: dict[str, str | None] = {}
        for pod, url in self.urls.items():
            try:
                shas[pod] = next((dict(labels)["sha256"] for (name, labels) in scrape(url)
                                  if name == "shapeshift_forward_pass_info"), None)
            except (httpx.HTTPError, KeyError):
                shas[pod] = None
        status = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "inferencedeployments",
                                                          self.deployment).get("status") or {}
        runs = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, "compileruns")["items"]
        drifted = next((c for c in status.get("conditions") or [] if c["type"] == "Drifted"), {})
        current = status.get("currentRegime") or {}
        return {"t": round(time.time() - self.t0, 2), "sha256": shas,
                "rollout": (status.get("rollout") or {}).get("phase"),
                "regime": current.get("name"), "observedRegime": current.get("observed"),
                "drift": drifted.get("reason"),
                "compileRuns": {r["metadata"]["name"]: (r.get("status") or {}).get("phase") or "Pending" for r in runs}}

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.samples.append(self.sample())
            except Exception as exc:  # noqa: BLE001 - a failed sample leaves a gap, never ends the recording
                self.samples.append({"t": round(time.time() - self.t0, 2), "error": repr(exc)[:300]})
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def events(self) -> list[dict[str, Any]]:
        listed = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={self.deployment}").items
        out = []
        for e in listed:
            when = e.last_timestamp or e.event_time or e.first_timestamp
            out.append({"t": round(when.timestamp() - self.t0, 1) if when else None, "reason": e.reason,
                        "message": (e.message or "")[:300]})
        return sorted(out, key=lambda e: (e["t"] is None, e["t"] or 0))


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _changes(samples: list[dict[str, Any]], key) -> list[tuple[float, Any]]:
    """(t, value) each time `key(sample)` changes."""
    out: list[tuple[float, Any]] = []
    for s in samples:
        if "error" in s:
            continue
        value = key(s)
        if not out or out[-1][1] != value:
            out.append((s["t"], value))
    return out


def timeline(load: RegimeLoad, recorder: Recorder, *, names: dict[str, str], events: list[dict[str, Any]],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything recorded, as JSON. `names`: sha256 -> a readable name (stock, the champions)."""
    requests = list(load.requests)
    end = max([r.end for r in requests] + [s["t"] for s in recorder.samples] + [0.0])
    buckets = []
    for i in range(int(end // BUCKET_S) + 1):
        lo, hi = i * BUCKET_S, (i + 1) * BUCKET_S
        done = [r for r in requests if lo <= r.end < hi]
        ok = [r.end - r.start for r in done if r.status == 200]
        buckets.append({"t": lo, "requestsPerSecond": round(len(done) / BUCKET_S, 2),
                        "p90LatencySeconds": None if not ok else round(_p90(ok), 4),
                        "failed": sum(1 for r in done if r.status != 200)})
    pods = sorted(load.urls)
    sha = {pod: [(t, v, names.get(v or "", (v or "?")[:12])) for t, v in
                 _changes(recorder.samples, lambda s, pod=pod: s["sha256"].get(pod))] for pod in pods}
    runs = sorted({name for s in recorder.samples if "error" not in s for name in s["compileRuns"]})
    return {
        "bucketSeconds": BUCKET_S,
        "requests": {"total": len(requests), "failed": sum(1 for r in requests if r.status != 200),
                     "byShape": {name: sum(1 for r in requests if r.shape == name) for name in
                                 sorted({r.shape for r in requests})}},
        "series": buckets,
        "shapes": load.shapes,
        "marks": recorder.marks,
        "sha256": sha,
        "rollout": _changes(recorder.samples, lambda s: s["rollout"]),
        "regime": _changes(recorder.samples, lambda s: (s["regime"], s["observedRegime"])),
        "drift": _changes(recorder.samples, lambda s: s["drift"]),
        "compileRuns": {name: _changes(recorder.samples, lambda s, name=name: s["compileRuns"].get(name))
                        for name in runs},
        "events": events,
        **(extra or {}),
    }


def write_timeline(data: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "timeline.json"
    json_path.write_text(json.dumps(data, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    png_path = folder / "timeline.png"
    plot_timeline(data, png_path)
    return json_path, png_path


def plot_timeline(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = data["series"]
    t = [b["t"] + data["bucketSeconds"] / 2 for b in series]
    fig, (rate, latency, passes) = plt.subplots(3, 1, figsize=(10, 6.2), sharex=True,
                                                gridspec_kw={"height_ratios": [2, 2, 1.4]})
    rate.plot(t, [b["requestsPerSecond"] for b in series], color="tab:blue")
    rate.set_ylabel("requests/s")
    latency.plot(t, [b["p90LatencySeconds"] * 1000 if b["p90LatencySeconds"] is not None else float("nan")
                     for b in series], color="tab:red")
    latency.set_ylabel("p90 latency (ms)")
    latency.set_yscale("log")
    end = t[-1] + data["bucketSeconds"] if t else 1.0
    colours = {}
    palette = ["tab:gray", "tab:green", "tab:orange", "tab:purple", "tab:brown"]
    pods = sorted(data["sha256"])
    for row, pod in enumerate(pods):
        changes = data["sha256"][pod]
        for i, (start, _sha, label) in enumerate(changes):
            stop = changes[i + 1][0] if i + 1 < len(changes) else end
            colour = colours.setdefault(label, palette[len(colours) % len(palette)])
            passes.barh(row, stop - start, left=start, color=colour, edgecolor="none", height=0.6)
    passes.set_yticks(range(len(pods)), [p.rsplit("-", 1)[-1] for p in pods])
    passes.set_ylabel("pod serves")
    passes.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
                  loc="upper left", fontsize=7, ncol=len(colours), framealpha=0.8)
    for when, text in data["marks"]:
        for ax in (rate, latency, passes):
            ax.axvline(when, color="black", linewidth=0.6, linestyle=":")
        rate.annotate(text, (when, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6.5,
                      va="top", ha="right")
    passes.set_xlabel("seconds since the load started")
    fig.suptitle("traffic A -> compile -> rollout -> traffic B -> compile -> rollout -> A again: switch, no compile",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

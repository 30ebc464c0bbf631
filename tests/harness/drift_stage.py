"""The drift tests' common stage: a real Prometheus scraping one engine's metrics, and an
InferenceDeployment compiled for short prompts (status.compiledFor) that watches it.

    server = scrape_engine(prometheus, namespace, "127.0.0.1:PORT")   # waits for its first series
    drifting_deployment(crds, namespace, server.url, replicas=0, cooldown_s=0)
"""

from __future__ import annotations

from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
NAME = "llama"
# What the deployment says it was compiled for: short prompts (the tests then serve long ones).
SHORT = TrafficProfile(name="short", prompt_length=LengthDistribution(p50=24, p90=30, p99=32),
                       output_length=LengthDistribution(p50=8, p90=8, p99=8), prefix_cache_hit_rate=0.5)


def scrape_engine(prometheus, namespace: str, target: str, timeout_s: float = 30.0):
    """A Prometheus (the `prometheus` fixture) scraping `target` every second as deployment llama's
    engine; returned once it holds the engine's first 40 prompt tokens."""
    server = prometheus([{
        "job_name": "engine", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [target], "labels": {"namespace": namespace, "deployment": NAME}}],
    }])
    server.wait_for(f'sum(shapeshift_prompt_tokens_count{{namespace="{namespace}"}})', lambda v: v >= 40,
                    timeout_s=timeout_s)
    return server


def drifting_deployment(crds, namespace: str, prometheus_url: str, *, replicas: int, cooldown_s: int,
                        check_interval_s: int = 10) -> None:
    """InferenceDeployment llama (tiny-llama, CPU, OnDrift after 2 drifting checks) compiled for SHORT."""
    custom = crds.custom
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": replicas,
            "prometheusUrl": prometheus_url,
            "compilation": {"policy": "OnDrift", "cooldownSeconds": cooldown_s,
                            "drift": {"consecutiveChecks": 2, "checkIntervalSeconds": check_interval_s,
                                      "windowSeconds": 60, "promptLengthRelativeChange": 0.3,
                                      "prefixHitRateAbsoluteChange": 0.15}},
        },
    })
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments", NAME,
                                                 {"status": {"compiledFor": SHORT.to_dict()}})

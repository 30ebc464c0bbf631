"""What forward pass an engine runs: one frozen record, kept by the engine.

``LLMEngine.active_forward_pass`` holds it; the engine sets it when a pass is installed (at
start, by a hot reload, by a rollback) and when a rollout names it. The metrics info label,
the admin API, the rollout agent's status and the measurement tiers read it from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shapeshift.engine.forward_pass.kv_layout import KVContext, kv_cache_tag, resolve


@dataclass(frozen=True)
class ActiveForwardPass:
    name: str  # the module's FORWARD_PASS_NAME, else the bundle's manifest name
    digest: str  # the bundle's digest (manifest), the identity rollouts compare against
    cache_format: str  # kv_cache_tag of the pass: the tag of the KV blocks it writes
    source: str  # where the bundle was loaded from (folder or archive path)
    recipe: dict[str, Any] = field(default_factory=dict, compare=False)
    resource: str | None = None  # the ForwardPass resource a rollout installed it as, if any
    # The KV layout it writes (kv_layout.py), resolved against the engine when one is known;
    # None: it declares none (its tag is its digest).
    kv_layout: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """The name the server reports (metrics info label): the resource's, else the module's."""
        return self.resource or self.name

    def named(self, resource: str | None) -> ActiveForwardPass:
        """The same pass, known as ForwardPass ``resource``."""
        return replace(self, resource=resource)

    @classmethod
    def of(cls, loaded: Any, source: str | None = None, resource: str | None = None, *,
           kv: KVContext | None = None) -> ActiveForwardPass:
        """The identity of an imported bundle (``importer.LoadedBundle``); ``kv``: the engine it
        runs in, whose model and settings fill in the declared KV layout (and so its tag)."""
        layout = loaded.kv_layout
        if kv is not None:
            layout = resolve(layout, kv)
        return cls(name=loaded.name, digest=loaded.manifest.digest,
                   cache_format=kv_cache_tag(layout, loaded.manifest.digest),
                   source=str(source if source is not None else loaded.bundle.source),
                   recipe=dict(loaded.recipe), resource=resource, kv_layout=layout)

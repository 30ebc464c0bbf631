"""The digest a ForwardPass records of the model config it was verified for (spec.model.configSha256).

    a model config (a random preset's config dict, a model folder's config.json)
      --config_sha256--> sha256 of its canonical JSON (sorted keys, no spaces)

The compile worker records it (engine/models/presets.model_config_sha256); the operator's regime
library compares it (operator/regimes.champion_problem): a champion of another config of the same
model name does not serve. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

__all__ = ["config_sha256"]


def config_sha256(config: Mapping[str, Any]) -> str:
    """sha256 of ``config`` in canonical JSON: the same for a config.json however it is formatted."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()

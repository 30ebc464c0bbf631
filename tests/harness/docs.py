"""The ```yaml blocks of a docs page, for the tests that hold a page to the code."""

from __future__ import annotations

import re
from pathlib import Path

import yaml


def yaml_blocks(page: Path) -> list[str]:
    """The text of each ```yaml block on `page`, in order."""
    return re.findall(r"```yaml\n(.*?)```", Path(page).read_text(), re.S)


def yaml_documents(page: Path) -> list[dict]:
    """Every YAML document of those blocks (a block may hold several, `---`-separated); empty ones left out."""
    return [doc for block in yaml_blocks(page) for doc in yaml.safe_load_all(block) if doc]

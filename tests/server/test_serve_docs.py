"""README's serve flag table agrees with `shapeshift serve --help`: the same flags, the same
defaults, and every `--flag` the serving section mentions exists.

To refresh the table after changing a flag, print it with
`python -c "from test_serve_docs import flag_table; print(flag_table())"` from tests/server.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Serving a model"


def serve_actions() -> list:
    from shapeshift.engine.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return [a for a in sub.choices["serve"]._actions if a.option_strings and a.option_strings[0] != "-h"]


def documented_default(action) -> str:
    """The default as --help states it: a concrete argparse default, else the help's own words."""
    if action.default not in (None, False, []) and not isinstance(action.default, bool):
        return str(action.default)
    help_text = " ".join((action.help or "").split())
    found = re.search(r"\(default: ([^)]*)\)", help_text) or re.search(r"[;(] ?default:? ([^;)]*)", help_text) \
        or re.search(r"Default: ([^.;]*)", help_text)
    if found:
        return found.group(1).strip()
    return "required" if action.required else "off"


def flag_table() -> str:
    rows = ["| flag | default |", "|---|---|"]
    rows += [f"| `{a.option_strings[0]}` | {documented_default(a)} |" for a in serve_actions()]
    return "\n".join(rows)


def _section() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end >= 0 else None]


def test_readme_flag_table_matches_help():
    section = _section()
    rows = dict(re.findall(r"^\| `(--[a-z0-9-]+)` \| (.*?) \|$", section, flags=re.M))
    actions = {a.option_strings[0]: a for a in serve_actions()}
    assert set(rows) == set(actions), (
        f"README's serve flag table and --help differ: only in README {sorted(set(rows) - set(actions))}, "
        f"only in --help {sorted(set(actions) - set(rows))}. Replace the table with flag_table()'s output "
        "(see this module's docstring)")
    wrong = {flag: (rows[flag], documented_default(a)) for flag, a in actions.items()
             if rows[flag] != documented_default(a)}
    assert not wrong, f"README default vs --help default: {wrong}; replace the table with flag_table()'s output"


def test_flags_mentioned_in_the_serving_section_exist_with_their_defaults():
    section = _section()
    actions = {a.option_strings[0]: a for a in serve_actions()}
    mentioned = set(re.findall(r"`(--[a-z0-9-]+)", section))
    assert mentioned <= set(actions), f"README mentions serve flags that do not exist: {mentioned - set(actions)}"
    for flag, default in re.findall(r"`(--[a-z0-9-]+)`, default (\w+)", section):
        assert default == documented_default(actions[flag]), (flag, default)

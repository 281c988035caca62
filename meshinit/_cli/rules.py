"""``meshinit plan --rules``: a logical-axis rule table, inline or from a file.

Inline, ``embed=fsdp,mlp=tensor``: ``name=a+b`` maps a name to several mesh axes and
``name=`` to none (replicated). A file: ``rules.json``, a JSON list of ``[name, axes]``
pairs (axes a string, a list of strings, or null), or a ``.yml``/``.yaml`` file with
MaxText's ``logical_axis_rules`` (the same pairs under that key). Whether each mesh
axis exists is the planner's check, made against the mesh each parameter lands on.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

Rule = tuple[str, str | tuple[str, ...] | None]

FORMAT = (
    "NAME=AXES pairs joined by commas (embed=fsdp,mlp=tensor; name=a+b for several mesh "
    "axes, name= for none), or a .json file (a list of [name, axes] pairs) or a "
    ".yml/.yaml file (MaxText's logical_axis_rules)"
)
HELP = (
    "logical names to mesh axes, as flax's and MaxText's rule tables: inline "
    "embed=fsdp,mlp=tensor (name=a+b for several axes, name= for none), or a file: a "
    ".json list of [name, axes] pairs, or a .yml/.yaml file with MaxText's "
    "logical_axis_rules. Specs without rules of their own, and nnx Variables with "
    "logical names, resolve through it (as rules= on meshinit.nnx.plan)"
)
HINT = (
    "hint: --rules embed=fsdp,mlp=tensor maps logical names to mesh axes "
    "(or --rules FILE: a .json list of [name, axes] pairs, or MaxText's .yml)"
)
# what a problem says when logical names met a mesh without rules to map them
ASKED = ("pass rules", "not in the mesh")
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_FILE_SUFFIXES = (".json", ".yml", ".yaml")


class RulesError(ValueError):
    """A ``--rules`` value that is not a rule table; its message is the whole line."""


def parse_rules(text: str) -> tuple[Rule, ...]:
    """The rule table ``--rules TEXT`` names: inline pairs, or a JSON or YAML file.

    Raises:
      RulesError: naming the value (or the file and entry), what is wrong, and the form
        expected.
    """
    path = pathlib.Path(text)
    if text.lower().endswith(_FILE_SUFFIXES) or ("=" not in text and path.is_file()):
        return _from_file(text, path)
    if "=" not in text:
        raise RulesError(
            f"--rules {text!r}: no such file, and not NAME=AXES pairs; expected {FORMAT}"
        )
    return _inline(text)


def _inline(text: str) -> tuple[Rule, ...]:
    rules: list[Rule] = []
    problems = []
    for part in text.split(","):
        name, eq, axes = (s.strip() for s in part.partition("="))
        if not eq:
            problems.append(f"{part.strip()!r} is not NAME=AXES")
            continue
        if not _NAME.fullmatch(name):
            problems.append(f"{name!r} is not a logical axis name")
            continue
        if not axes:
            rules.append((name, None))
            continue
        names = [a.strip() for a in axes.split("+")]
        bad = [a for a in names if not a.isidentifier()]
        if bad:
            problems.append(
                f"{part.strip()!r}: {', '.join(map(repr, bad))} is not a mesh axis name"
            )
        elif len(set(names)) != len(names):
            problems.append(f"{part.strip()!r} names a mesh axis twice")
        else:
            rules.append((name, names[0] if len(names) == 1 else tuple(names)))
    if problems:
        raise RulesError(f"--rules {text!r}: {'; '.join(problems)}; expected {FORMAT}")
    return tuple(rules)


def _from_file(text: str, path: pathlib.Path) -> tuple[Rule, ...]:
    if not path.is_file():
        raise RulesError(f"--rules {text}: no such file; expected {FORMAT}")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RulesError(f"--rules {text}: cannot read it: {e}") from None
    if path.suffix.lower() in (".yml", ".yaml"):
        table = _yaml_rules(text, source)
    else:
        try:
            table = json.loads(source)
        except json.JSONDecodeError as e:
            raise RulesError(f"--rules {text}: not JSON: {e}") from None
        if isinstance(table, dict) and "logical_axis_rules" in table:
            table = table["logical_axis_rules"]
    return _pairs(text, table)


def _yaml_rules(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise RulesError(
            f"--rules {text}: reading a YAML file needs PyYAML, which is not installed: "
            f"pip install pyyaml (or give the rules as JSON)"
        ) from None
    try:
        config = yaml.safe_load(source)
    except yaml.YAMLError as e:
        raise RulesError(f"--rules {text}: not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict) or "logical_axis_rules" not in config:
        keys = ", ".join(map(str, config)) if isinstance(config, dict) else type(config).__name__
        raise RulesError(
            f"--rules {text}: no logical_axis_rules key (found: {keys or 'nothing'}); a YAML "
            f"rules file holds MaxText's logical_axis_rules: a list of [name, axes] pairs"
        )
    return config["logical_axis_rules"]


def _pairs(text: str, table: Any) -> tuple[Rule, ...]:
    if not isinstance(table, list):
        raise RulesError(
            f"--rules {text}: a {type(table).__name__}, not a list of [name, axes] pairs"
        )
    rules: list[Rule] = []
    problems = []
    for i, pair in enumerate(table):
        ok = isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
        axes = pair[1] if ok else None
        if ok and isinstance(axes, list):
            ok = all(isinstance(a, str) for a in axes) and len(set(axes)) == len(axes)
            axes = tuple(axes)
        elif ok:
            ok = axes is None or isinstance(axes, str)
        if ok:
            rules.append((pair[0], axes))
        else:
            problems.append(f"entry {i} {json.dumps(pair, default=str)}")
    if problems:
        raise RulesError(
            f"--rules {text}: {', '.join(problems[:5])}"
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ": each entry is [name, axes], axes a mesh axis name, a list of distinct "
            "names, or null"
        )
    return tuple(rules)

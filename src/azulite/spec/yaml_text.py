"""A spec file's YAML with where each field sits: the parsed mapping beside PyYAML's composed node tree, which
carries the line of every key and the text of every scalar as written.

Why by hand: no library joins a node tree's marks to pydantic's field paths, and PyYAML (YAML 1.1, as
azure-ai-ml reads job files too) resolves plain scalars that a string field must keep as written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from azulite.errors import SpecError

Path_ = tuple  # a field path: ("distribution", "process_count_per_instance")

# Mappings whose values are strings however they look (a process environment holds only text).
TEXT_MAPPINGS: tuple[Path_, ...] = (("environment_variables",), ("trial", "environment_variables"))


def dotted(path: Iterable[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def parse(text: str, shown: str) -> tuple[Any, yaml.Node | None]:
    """The document's data and node tree; invalid YAML and a key given twice in one mapping (YAML keeps the
    last silently, so the first is lost) are a SpecError at their line. Values of :data:`TEXT_MAPPINGS` are
    the text the file writes (:func:`as_written`)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise SpecError(f"not valid YAML: {exc.problem or exc}", file=shown, line=mark.line + 1 if mark else None,
                        fix="check indentation and quoting around this line") from None
    if (twice := duplicate_key(node)) is not None:
        where, first, again = twice
        raise SpecError(f"{where} is given twice (lines {first} and {again}); YAML would keep only the last",
                        file=shown, line=again, fix="keep one of them")
    as_written(data, node)
    return data, node


def line_map(node: yaml.Node | None, path: Path_ = ()) -> dict[Path_, int]:
    """Field path -> 1-based line of its key (of the item, for sequences)."""
    lines: dict[Path_, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = path + (key_node.value,)
            lines[sub] = key_node.start_mark.line + 1
            lines.update(line_map(value_node, sub))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            lines.update(line_map(item, path + (i,)))
    return lines


def duplicate_key(node: yaml.Node | None, path: Path_ = ()) -> tuple[str, int, int] | None:
    """The first key a mapping gives twice: (its dotted path, first line, second line)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                return dotted(path + (key_node.value,)), seen[key_node.value], line
            seen[key_node.value] = line
            if (found := duplicate_key(value_node, path + (key_node.value,))) is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := duplicate_key(item, path + (i,))) is not None:
                return found
    return None


def _resolved(value: Any) -> bool:
    """A scalar YAML 1.1 turned into something other than text (``yes`` -> True, ``010`` -> 8, ``12:30`` ->
    750, ``0x1F`` -> 31, ``1_000`` -> 1000)."""
    return isinstance(value, (bool, int, float))


def as_written(data: Any, node: yaml.Node | None, paths: Iterable[Path_] = TEXT_MAPPINGS) -> None:
    """Give each mapping at ``paths`` its plain (unquoted) keys and values as the file writes them, where
    YAML 1.1 resolved them to a boolean or a number: ``DEBUG: yes`` is "yes", not "True"; ``UMASK: 022``
    "022", not "18". Quoted scalars, nulls and nested collections are left as parsed."""
    for path in paths:
        target, mapping = data, node
        for part in path:
            target = target.get(part) if isinstance(target, dict) else None
            mapping = next((v for k, v in mapping.value if k.value == part), None) \
                if isinstance(mapping, yaml.MappingNode) else None
        if not isinstance(target, dict) or not isinstance(mapping, yaml.MappingNode):
            continue
        pairs = mapping.value
        if len(pairs) != len(target) or any(k.tag == "tag:yaml.org,2002:merge" for k, _ in pairs):
            continue  # a merge key (<<) brought entries the nodes do not line up with: leave it as parsed
        rebuilt = {}
        for (key_node, value_node), (key, value) in zip(pairs, target.items()):  # a dict keeps the file's order
            if isinstance(key_node, yaml.ScalarNode) and key_node.style is None and _resolved(key):
                key = key_node.value
            if isinstance(value_node, yaml.ScalarNode) and value_node.style is None and _resolved(value):
                value = value_node.value
            rebuilt[key] = value
        target.clear()
        target.update(rebuilt)


def override_as_written(path: Path_, value: Any, raw: str, paths: Iterable[Path_] = TEXT_MAPPINGS) -> Any:
    """A ``--set`` value for a field of a mapping at ``paths`` as typed (``--set environment_variables.A=010``
    is "010"); any other field's value as parsed."""
    if len(path) >= 1 and path[:-1] in tuple(paths) and _resolved(value):
        return raw.strip()
    return value

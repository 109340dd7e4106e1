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
#: collections inside collections, aliases followed: PyYAML composes a node tree recursively (a RecursionError
#: near 500 levels), and so do the walks here and pydantic; no spec comes near 20
MAX_DEPTH = 100
#: values of a document with its aliases expanded (each alias counts its anchor's whole value): a few
#: nested aliases ("billion laughs") make a small file a tree too large to walk
MAX_VALUES = 1_000_000


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
        check_shape(text, shown)  # before composing: a node tree too deep or recursive breaks what walks it
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


class _Open:
    """A collection being read: where it sits, how deep it goes, how many values it holds expanded."""

    __slots__ = ("path", "mapping", "anchor", "key", "index", "depth", "deepest", "size", "closed")

    def __init__(self, path: Path_, mapping: bool, anchor: str | None, depth: int) -> None:
        self.path, self.mapping, self.anchor, self.depth = path, mapping, anchor, depth
        self.key: Any = None  # a mapping's key whose value comes next (None: a key comes next)
        self.index = 0
        self.deepest = depth
        self.size = 0
        self.closed = False


def check_shape(text: str, shown: str, *, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> None:
    """A SpecError at the line and field of an alias inside the value it names (``x: &a [*a]``: endless), of a
    value nested deeper than ``max_depth`` collections (aliases followed), or where the values with aliases
    expanded pass ``max_values``. One pass over PyYAML's events, which its parser makes without recursion;
    its invalid YAML raises as :func:`parse` reports it."""
    stack: list[_Open] = []
    anchors: dict[str, tuple[_Open | None, int, int]] = {}  # anchor -> (its collection, levels, values)
    total = 0

    def where(event: yaml.Event) -> tuple[Path_, int]:
        """The field path of the node ``event`` starts, and its line; advances the parent's key/index."""
        line = event.start_mark.line + 1
        if not stack:
            return (), line
        parent = stack[-1]
        if parent.mapping:
            if parent.key is None:  # this node is a key
                parent.key = event.value if isinstance(event, yaml.ScalarEvent) else "?"
                return parent.path + (parent.key,), line
            path, parent.key = parent.path + (parent.key,), None
            return path, line
        parent.index += 1
        return parent.path + (parent.index - 1,), line

    def fail(message: str, path: Path_, line: int, fix: str) -> SpecError:
        field = dotted(path[:8]) + ("..." if len(path) > 8 else "")  # a path 100 levels long says no more
        return SpecError(message, file=shown, line=line, field=field or None, fix=fix)

    def add(levels: int, values: int, path: Path_, line: int) -> None:
        """A child of ``levels`` collections and ``values`` values (expanded) in the innermost open one."""
        nonlocal total
        if len(stack) + levels > max_depth:
            raise fail(f"the value is nested deeper than {max_depth} levels", path, line,
                       "flatten the structure: a spec needs a few levels of mappings and lists")
        if stack:
            stack[-1].deepest = max(stack[-1].deepest, len(stack) + levels)
            stack[-1].size += values
        total += values
        if total > max_values:
            raise fail(f"the document's aliases expand to more than {max_values:,} values", path, line,
                       "write the values out, or use fewer nested aliases (*name)")

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            path, line = where(event)
            add(1, 1, path, line)
            opened = _Open(path, isinstance(event, yaml.MappingStartEvent), event.anchor, len(stack) + 1)
            if event.anchor is not None:
                anchors[event.anchor] = (opened, 0, 0)
            stack.append(opened)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            done.closed = True
            if stack:
                stack[-1].deepest = max(stack[-1].deepest, done.deepest)
                stack[-1].size += done.size
            if done.anchor is not None and anchors.get(done.anchor, (None,))[0] is done:  # not named again inside
                anchors[done.anchor] = (done, done.deepest - done.depth + 1, done.size + 1)
        elif isinstance(event, yaml.ScalarEvent):
            path, line = where(event)
            add(0, 1, path, line)
            if event.anchor is not None:
                anchors[event.anchor] = (None, 0, 1)
        elif isinstance(event, yaml.AliasEvent):
            path, line = where(event)
            opened, levels, values = anchors.get(event.anchor, (None, 0, 1))
            if opened is not None and not opened.closed:
                raise fail(f"the YAML alias *{event.anchor} refers to itself (it sits inside the value "
                           f"&{event.anchor} names), so the value never ends", path, line,
                           f"write the value out here, or point *{event.anchor} at an anchor outside it")
            add(levels, values, path, line)
        elif isinstance(event, yaml.DocumentEndEvent):
            anchors.clear()


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

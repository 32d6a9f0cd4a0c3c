"""Reading README.md and DynamicEmb_APIs.md as the docs tests need them: their
fenced code blocks, and the reference entries of DynamicEmb_APIs.md.

Conventions (stated at the top of DynamicEmb_APIs.md):

- A reference entry is a level-4 heading that starts with a code span naming
  the object, optionally with its signature: ``#### `Name` `` or
  ``#### `Name(a, b=1, *, c=None)` ``. It documents ``Name`` of the module
  named by the enclosing level-3 heading, which is a code span holding only a
  module path: ``### `dynamicemb.tiers` ``. Any heading of level 3 or less
  that is not such a module heading ends the module's section.
- A ```python block runs unless the line right before its fence is
  ``<!-- not-run: reason -->``.
"""
import re
from dataclasses import dataclass
from typing import List, Optional

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_MODULE = re.compile(r"^`(dynamicemb(?:\.\w+)*)`$")
_ENTRY = re.compile(r"^`(\w+)(?:\((.*?)\))?`")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->$")


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: Optional[str]  # the reason, when marked not-run

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Entry:
    module: str
    name: str
    params: Optional[str]  # the signature's parameters as written, None without parentheses
    line: int
    body: str  # the text up to the next heading


def _lines_outside_code(text: str):
    """(line number, line, inside a fenced block) for every line."""
    inside = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            yield i, line, True
            inside = not inside
            continue
        yield i, line, inside


def code_blocks(path: str, text: str) -> List[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: unclosed code block")
        prev = lines[start - 1].strip() if start > 0 else ""
        marker = _NOT_RUN.match(prev)
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return blocks


def reference_entries(text: str) -> List[Entry]:
    entries: List[Entry] = []
    module = None
    current: Optional[Entry] = None
    for i, line, in_code in _lines_outside_code(text):
        h = None if in_code else _HEADING.match(line)
        if h is None:
            if current is not None:
                current.body += line + "\n"
            continue
        level, title = len(h.group(1)), h.group(2)
        current = None
        if level <= 3:
            m = _MODULE.match(title) if level == 3 else None
            module = m.group(1) if m else None
        elif level == 4 and module is not None:
            e = _ENTRY.match(title)
            if e:
                current = Entry(module, e.group(1), e.group(2), i, "")
                entries.append(current)
    return entries


def dotted_references(text: str) -> List[str]:
    """Every `dynamicemb.x.y` named in a code span outside code blocks."""
    found = []
    for _, line, in_code in _lines_outside_code(text):
        if in_code:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            found += re.findall(r"(?<![\w/.])dynamicemb(?:\.[A-Za-z_]\w*)+", span)
    return found


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives the headings: lower case, punctuation but
    '-' and '_' dropped, spaces to '-', repeats numbered (-1, -2, ...)."""
    seen, anchors = {}, set()
    for _, line, in_code in _lines_outside_code(text):
        h = None if in_code else _HEADING.match(line)
        if h is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", h.group(2).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def local_links(text: str) -> list:
    """(anchor) of every [text](#anchor) link outside code blocks."""
    found = []
    for _, line, in_code in _lines_outside_code(text):
        if not in_code:
            found += re.findall(r"\]\(#([^)\s]+)\)", line)
    return found

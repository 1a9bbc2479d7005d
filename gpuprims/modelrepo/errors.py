"""The model repository's one error type, and the line of a field in ``config.pbtxt`` text.

protobuf's text parser gives the line of a syntax error but a parsed message keeps no positions, so a
semantic error (``dims: [ 0 ]``) is placed by :class:`TextIndex`, a small reader of the text format's
structure that maps a field path (``input[1].dims``) to the line it is written on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field


class ModelConfigError(ValueError):
    """A model's configuration is malformed, refused or does not match its files.

    ``str()`` is one line, ``FILE:LINE: FIELD: what is wrong`` (``FILE: FIELD: ...`` when no line
    applies, such as a missing model file). Pickles (it crosses to the node from a loader process).
    """

    def __init__(self, file: str, line: int | None, field: str, message: str) -> None:
        self.file = str(file)
        self.line = line
        self.field = field
        # One line, always: a library's multi-line message (a protobuf decode error) is joined.
        self.message = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        where = f"{self.file}:{line}" if line is not None else self.file
        super().__init__(f"{where}: {field}: {self.message}")

    def __reduce__(self) -> tuple[type, tuple[str, int | None, str, str]]:
        return (type(self), (self.file, self.line, self.field, self.message))


# -- where a field is written ------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<word>[A-Za-z0-9_.+\-]+)
  | (?P<punct>[{}\[\]<>:,;])
  | (?P<newline>\n)
  | (?P<space>[ \t\r\f\v]+)
""", re.VERBOSE)


@dataclass
class _Node:
    name: str
    line: int
    value: str | None = None
    children: list[_Node] = field(default_factory=list)


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, line) of every token but comments and spaces; unknown characters are skipped
    (the text has already passed protobuf's parser when it is indexed)."""
    out: list[tuple[str, str, int]] = []
    line = 1
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            pos += 1
            continue
        kind = m.lastgroup or ""
        if kind == "newline":
            line += 1
        elif kind in ("word", "string", "punct"):
            out.append((kind, m.group(), line))
        pos = m.end()
    return out


class TextIndex:
    """The fields of a ``config.pbtxt`` text with their lines, to place an error.

    :meth:`line` takes a path of ``(field, selector)`` steps: selector ``None`` is the first
    occurrence, an int the n-th element of a repeated field (however the text writes the list),
    a str the entry of a map field (``parameters``) whose ``key`` is that string.
    """

    def __init__(self, text: str) -> None:
        self._toks = _tokens(text)
        self._i = 0
        self.root = _Node("", 1, children=self._fields(("",)))

    def _peek(self) -> tuple[str, str, int] | None:
        return self._toks[self._i] if self._i < len(self._toks) else None

    def _fields(self, closers: tuple[str, ...]) -> list[_Node]:
        out: list[_Node] = []
        while (tok := self._peek()) is not None and tok[1] not in closers:
            kind, name, line = tok
            self._i += 1
            if kind != "word":
                continue  # a stray separator
            if (t := self._peek()) is not None and t[1] == ":":
                self._i += 1
            out.extend(self._value(name, line))
            if (t := self._peek()) is not None and t[1] in (",", ";"):
                self._i += 1
        if self._peek() is not None:
            self._i += 1  # the closer
        return out

    def _value(self, name: str, line: int) -> list[_Node]:
        tok = self._peek()
        if tok is None:
            return [_Node(name, line)]
        if tok[1] in ("{", "<"):
            self._i += 1
            return [_Node(name, line, children=self._fields(("}" if tok[1] == "{" else ">",)))]
        if tok[1] == "[":
            self._i += 1
            items: list[_Node] = []
            while (t := self._peek()) is not None and t[1] != "]":
                if t[1] == ",":
                    self._i += 1
                    continue
                items.extend(self._value(name, t[2]))
            self._i += 1
            return items or [_Node(name, line)]
        self._i += 1
        value = tok[1]
        while tok[0] == "string" and (t := self._peek()) is not None and t[0] == "string":
            value = value[:-1] + t[1][1:]  # adjacent strings concatenate
            self._i += 1
        return [_Node(name, line, value=value)]

    def line(self, path: Sequence[tuple[str, int | str | None]]) -> int:
        """The line of the deepest step of ``path`` the text writes (1 when it writes none)."""
        node = self.root
        best = 1
        for name, sel in path:
            found = [c for c in node.children if c.name == name]
            if isinstance(sel, int):
                nxt = found[sel] if sel < len(found) else None
            elif isinstance(sel, str):
                nxt = next((c for c in found if any(k.name == "key" and _unquote(k.value) == sel
                                                    for k in c.children)), None)
            else:
                nxt = found[0] if found else None
            if nxt is None:
                return best
            node = nxt
            best = nxt.line
        return best


def _unquote(value: str | None) -> str | None:
    if value is not None and len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def field_name(path: Sequence[tuple[str, int | str | None]]) -> str:
    """``input[1].dims`` / ``parameters["gpu_pct"]`` for a path of steps (see :meth:`TextIndex.line`)."""
    parts = []
    for name, sel in path:
        if isinstance(sel, int):
            parts.append(f"{name}[{sel}]")
        elif isinstance(sel, str):
            parts.append(f"{name}[{sel!r}]")
        else:
            parts.append(name)
    return ".".join(parts)

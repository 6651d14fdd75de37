"""Bounds on a constraint, checked in Python before llama.cpp or its converter sees it.

llama.cpp's GBNF parser and its left-recursion check recurse without limit (a grammar
nested 30000 deep overflows the C stack and kills the server), a `{m,n}` over a literal is
copied m times, and the left-recursion walk does not memoise, so a small text can ask for
gigabytes or hours. `check_schema` bounds a JSON schema's repetition counts before it is
converted; `check_gbnf` makes one non-recursive pass over a GBNF text (size, nesting,
repetitions, the elements llama.cpp would build, the left-recursion walk's depth and work).
Repetition counts are capped at 2000, as llama.cpp caps them. Each refusal is a ConfigError
that starts with the request field it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from specwire.config import ConfigError

#: llama.cpp's MAX_REPETITION_THRESHOLD (llama-grammar.cpp).
MAX_REPETITION = 2000
#: Largest GBNF text accepted (characters).
MAX_GBNF_CHARS = 1 << 20
#: Nested groups: each level is two C++ frames of llama.cpp's parser.
MAX_NESTING = 256
#: Grammar elements llama.cpp would build, repetitions expanded (8 bytes each).
MAX_ELEMENTS = 1_000_000
#: Depth of llama.cpp's left-recursion walk (a C++ frame per rule along a leftmost chain).
MAX_CHAIN = 4000
#: Rule visits of that walk (it does not memoise: diamonds of leftmost rules multiply).
MAX_WALK = 2_000_000

REPETITION_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                   "maxProperties", "minContains", "maxContains")
#: Schema keywords whose values are data, not schemas (a key "maxLength" there is a value).
DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})


def check_schema(schema: Any, origin: str) -> None:
    """Repetition counts of a JSON schema within MAX_REPETITION, anywhere in it."""
    stack: list[tuple[Any, str]] = [(schema, origin)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        for key, v in value.items():
            path = f"{where}.{key}"
            if isinstance(v, dict | list):
                if key not in DATA_KEYS:
                    stack.append((v, path))
            elif key in REPETITION_KEYS:
                _count(v, path)
            elif key == "pattern" and isinstance(v, str):
                check_pattern(v, path)


def _count(v: Any, where: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{where}: must be a non-negative integer")
    if v > MAX_REPETITION:
        raise ConfigError(f"{where}: {v} is over {MAX_REPETITION}, llama.cpp's limit on "
                          "repetitions in a grammar")


_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_pattern(pattern: str, where: str) -> None:
    """Every {m}, {m,} and {m,n} of a regular expression within MAX_REPETITION."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "{":
            m = _QUANTIFIER.match(pattern, i)
            if m:
                for digits in m.groups():
                    if digits and (len(digits) > 9 or int(digits) > MAX_REPETITION):
                        raise ConfigError(f"{where}: the repetition {m.group(0)[:40]} is over "
                                          f"{MAX_REPETITION}, llama.cpp's limit")
                i = m.end()
                continue
        i += 1


# -- GBNF -----------------------------------------------------------------------------------


_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_CLASS = re.compile(r"\[(?:[^\]\\]|\\.)*\]", re.S)


@dataclass(slots=True)
class _Rule:
    """A rule as llama.cpp builds it, for its left-recursion walk.

    edges: (child rule, visits of the child per visit of this rule, depth added on the
    way) for each reference that the walk reaches from the start of an alternative.
    empty: an alternative with no symbol (llama.cpp's "may be empty", which lets the
    walk go on to the next symbol).
    """

    edges: list[tuple[int, int, int]] = field(default_factory=list)
    empty: bool = False


@dataclass(slots=True)
class _Seq:
    """The alternative being read."""

    rule: int
    open: bool = True          # the walk reaches the next symbol
    size: int = 0              # symbols so far
    last: tuple[int, int, bool] | None = None  # last symbol: elements, rule id or -1, reached


class _Scanner:
    """One pass over a GBNF text, as llama.cpp's parser reads it, with a stack of groups
    instead of recursion. Where llama.cpp would stop with a syntax error, so does this."""

    def __init__(self, text: str, origin: str) -> None:
        self.text, self.origin = text, origin
        self.rules: list[_Rule] = []
        self.names: dict[str, int] = {}
        self.elements = 0

    def fail(self, why: str) -> ConfigError:
        return ConfigError(f"{self.origin}: the grammar {why}")

    def rule_id(self, name: str) -> int:
        rid = self.names.get(name)
        if rid is None:
            rid = self.names[name] = self.new_rule()
        return rid

    def new_rule(self) -> int:
        self.rules.append(_Rule())
        return len(self.rules) - 1

    def word_end(self, i: int) -> int:
        text, n = self.text, len(self.text)
        while i < n and text[i] in _WORD:
            i += 1
        return i

    def scan(self) -> None:
        text, n, i = self.text, len(self.text), 0
        stack: list[_Seq] = []          # the rule's alternative, then one per open group
        while i < n:
            c = text[i]
            if c == "#":
                while i < n and text[i] not in "\r\n":
                    i += 1
                continue
            if c in " \t\r\n":
                if c in "\r\n" and len(stack) == 1 and stack[0].size:
                    self.end_alternative(stack.pop())      # a newline ends the rule
                i += 1
                continue
            if not stack:               # a rule's head: name ::=
                j = self.word_end(i)
                k = j
                while k < n and text[k] in " \t":
                    k += 1
                if j == i or text[k:k + 3] != "::=":
                    return
                stack.append(_Seq(self.rule_id(text[i:j])))
                i = k + 3
                continue
            seq = stack[-1]
            if c in '"[':
                m = (_LITERAL if c == '"' else _CLASS).match(text, i)
                if m is None:
                    return
                self.terminal(seq, m.end() - m.start() - 2)
                i = m.end()
            elif c == "<" or (c == "!" and text[i + 1:i + 2] == "<"):
                j = text.find(">", i)
                if j < 0:
                    return
                self.terminal(seq, 1)
                i = j + 1
            elif c == ".":
                self.terminal(seq, 1)
                i += 1
            elif c in _WORD:
                j = self.word_end(i)
                self.reference(seq, self.rule_id(text[i:j]))
                i = j
            elif c == "(":
                if len(stack) > MAX_NESTING:
                    raise self.fail(f"nests groups deeper than {MAX_NESTING} levels")
                stack.append(_Seq(self.new_rule()))
                i += 1
            elif c == ")":
                if len(stack) < 2:
                    return
                inner = stack.pop()
                self.end_alternative(inner)
                self.reference(stack[-1], inner.rule)
                i += 1
            elif c == "|":
                self.end_alternative(seq)
                stack[-1] = _Seq(seq.rule)
                i += 1
            elif c in "*+?":
                self.repeat(seq, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
                i += 1
            elif c == "{":
                m = _QUANTIFIER.match(text, i)
                if m is None or not m.group(1):
                    return
                self.repeat(seq, *self.counts(m))
                i = m.end()
            else:
                return
            if self.elements > MAX_ELEMENTS:
                raise self.fail(f"would make llama.cpp build over {MAX_ELEMENTS} elements "
                                "(long literals repeated many times?)")
        if stack:
            self.end_alternative(stack[0])

    def counts(self, m: re.Match) -> tuple[int, int | None]:
        lo_s, hi_s = m.group(1), m.group(2)
        for digits in (lo_s, hi_s):
            if digits and (len(digits) > 9 or int(digits) > MAX_REPETITION):
                raise self.fail(f"repeats {m.group(0)[:40]}: over {MAX_REPETITION}, "
                                "llama.cpp's limit")
        lo = int(lo_s)
        if hi_s is None:                # {m} or {m,}
            return lo, None if "," in m.group(0) else lo
        return lo, int(hi_s) if hi_s else None

    def terminal(self, seq: _Seq, length: int) -> None:
        self.elements += length + 1
        seq.last = (length, -1, seq.open)
        seq.open = False
        seq.size += 1

    def reference(self, seq: _Seq, child: int) -> None:
        self.elements += 1
        if seq.open:
            self.rules[seq.rule].edges.append((child, 1, 1))
        seq.last = (1, child, seq.open)
        seq.open = seq.open and self.rules[child].empty
        seq.size += 1

    def repeat(self, seq: _Seq, lo: int, hi: int | None) -> None:
        """As llama.cpp expands it: the last symbol copied lo times, then a chain of
        hi - lo rules `symbol next |` (one rule referring to itself when unbounded)."""
        if seq.last is None:
            return
        length, child, reached = seq.last
        n_opt = 1 if hi is None else max(hi - lo, 0)
        self.elements += length * max(lo - 1, 0) + n_opt * (length + 3)
        empty = child >= 0 and self.rules[child].empty
        seq.open = reached and (lo == 0 or empty)
        if child < 0 or not reached:
            return
        edges = self.rules[seq.rule].edges
        edges.pop()                     # the one reference becomes the copies and the chain
        if lo:
            edges.append((child, lo if empty else 1, 1))
        if n_opt and (lo == 0 or empty):
            # the walk goes down the chain, visiting the symbol at each rule, only as long
            # as the symbol may be empty
            edges.append((child, n_opt, n_opt) if empty else (child, 1, 1))

    def end_alternative(self, seq: _Seq) -> None:
        if seq.size == 0:
            self.rules[seq.rule].empty = True

    def walk_bounds(self) -> tuple[int, int]:
        """(deepest recursion, total visits) of llama.cpp's left-recursion walk, which it
        starts from every rule; a cycle (left recursion: llama.cpp refuses it) ends a walk."""
        n = len(self.rules)
        depth, visits = [0] * n, [0] * n
        state = [0] * n                 # 0 new, 1 on the stack, 2 done
        for start in range(n):
            if state[start]:
                continue
            stack = [(start, 0)]
            state[start] = 1
            while stack:
                rid, k = stack[-1]
                edges = self.rules[rid].edges
                if k < len(edges):
                    stack[-1] = (rid, k + 1)
                    child = edges[k][0]
                    if state[child] == 0:
                        state[child] = 1
                        stack.append((child, 0))
                    continue
                stack.pop()
                state[rid] = 2
                d, v = 1, 1
                for child, times, extra in edges:
                    if state[child] == 2 and child != rid:
                        d = max(d, extra + depth[child])
                        v = min(v + times * visits[child], MAX_WALK + 1)
                depth[rid], visits[rid] = d, v
        return max(depth, default=0), sum(visits)


def check_gbnf(text: str, origin: str) -> None:
    """A GBNF text that llama.cpp can parse and check within bounded stack, memory and time.

    Only the bounds are checked; syntax errors are left to llama.cpp, which names them.
    """
    if len(text) > MAX_GBNF_CHARS:
        raise ConfigError(f"{origin}: the grammar is {len(text)} characters, over "
                          f"{MAX_GBNF_CHARS}")
    scanner = _Scanner(text, origin)
    scanner.scan()
    chain, walk = scanner.walk_bounds()
    if chain > MAX_CHAIN:
        raise scanner.fail(f"has a chain of {chain} rules at the start of each other, over "
                           f"{MAX_CHAIN}")
    if walk > MAX_WALK:
        raise scanner.fail(f"has over {MAX_WALK} paths through rules at the start of each "
                           "other (llama.cpp's left-recursion check visits each)")

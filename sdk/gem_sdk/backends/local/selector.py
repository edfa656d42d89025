"""Label selectors as kube-apiserver reads them, for `list(label_selector=...)` of local jobs.

A port of `labels.Parse` (k8s.io/apimachinery/pkg/labels/selector.go): its lexer, grammar and
`NewRequirement` checks, so that `gemctl list --local -l SEL` accepts and refuses what
`kubectl get -l SEL` does and matches the same jobs: `a=b`, `a==b`, `a!=b`, `a in (x,y)`,
`a notin (x)`, `a`, `!a`, `a>1`, `a<1`, requirements joined by `,` (all must hold). What it
refuses raises `ValidationError` naming the selector and the reason (gemctl: exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from gem.api.validation import label_key_problem, label_value_problem
from gem_sdk._exceptions import ValidationError

#: labels.Lexer: blanks are skipped; `=!(),><` runs are operators (the longest that is one: `!=`,
#: `==`); anything else up to a blank or one of them is an identifier (`in`, `notin` keywords).
_TOKEN = re.compile(r"[ \t\r\n]*(?:(?P<op>!=|==|[=!(),><])|(?P<ident>[^ \t\r\n=!(),><]+))")
_IDENT, _END = "identifier", "end of string"
_OPERATORS = ("=", "==", "!=", "in", "notin", ">", "<")
_INT64 = re.compile(r"[+-]?[0-9]+")


class _Error(Exception):
    pass


def _lex(selector: str) -> list[tuple[str, str]]:
    """(token, literal) pairs, ending with (_END, "")."""
    out, pos = [], 0
    while True:
        m = _TOKEN.match(selector, pos)
        if m is None:  # only blanks are left
            out.append((_END, _END))
            return out
        pos = m.end()
        if m["op"]:
            out.append((m["op"], m["op"]))
        else:
            word = m["ident"]
            out.append((word if word in ("in", "notin") else _IDENT, word))


class _Parser:
    def __init__(self, selector: str) -> None:
        self.items, self.pos = _lex(selector), 0

    def lookahead(self, values: bool = True) -> tuple[str, str]:
        tok, lit = self.items[self.pos]
        # Where a key or value may stand, `in` and `notin` are identifiers (`in in (notin)`).
        return (_IDENT if values and tok in ("in", "notin") else tok), lit

    def consume(self, values: bool = True) -> tuple[str, str]:
        item = self.lookahead(values)
        self.pos = min(self.pos + 1, len(self.items) - 1)
        return item

    def parse(self) -> list[tuple[str, str, list[str]]]:
        reqs = []
        while True:
            tok, lit = self.lookahead()
            if tok == _END:
                return reqs
            if tok not in (_IDENT, "!"):
                raise _Error(f"found '{lit}', expected: !, identifier, or 'end of string'")
            try:
                reqs.append(self.requirement())
            except _Error as e:
                raise _Error(f"unable to parse requirement: {e}") from None
            tok, lit = self.consume()
            if tok == _END:
                return reqs
            if tok != ",":
                raise _Error(f"found '{lit}', expected: ',' or 'end of string'")
            tok, lit = self.lookahead()
            if tok not in (_IDENT, "!"):
                raise _Error(f"found '{lit}', expected: identifier after ','")

    def requirement(self) -> tuple[str, str, list[str]]:
        op = None
        tok, key = self.consume()
        if tok == "!":
            op, (tok, key) = "!", self.consume()
        if tok != _IDENT:
            raise _Error(f"found '{key}', expected: identifier")
        problem = label_key_problem(key)
        if problem:
            raise _Error(problem)
        if op is None and self.lookahead()[0] in (_END, ","):
            op = "exists"
        if op is not None:
            return key, op, []
        tok, lit = self.consume(values=False)
        if tok not in _OPERATORS:
            raise _Error(f"found '{lit}', expected: '=', '!=', '==', 'in', 'notin', '>' or '<'")
        values = self.values() if tok in ("in", "notin") else self.exact_value()
        for value in values:
            problem = label_value_problem(value)
            if problem:
                raise _Error(problem)
        if tok in (">", "<") and not (_INT64.fullmatch(values[0]) and -2**63 <= int(values[0]) < 2**63):
            raise _Error(f"{values[0]!r}: for '>' and '<' the value must be an integer")
        return key, tok, values

    def values(self) -> list[str]:
        tok, lit = self.consume()
        if tok != "(":
            raise _Error(f"found '{lit}', expected: '('")
        tok, lit = self.lookahead()
        if tok == ")":  # "()": the empty value
            self.consume()
            return [""]
        if tok not in (_IDENT, ","):
            raise _Error(f"found '{lit}', expected: ',', ')' or identifier")
        values = self.identifiers()
        tok, lit = self.consume()
        if tok != ")":
            raise _Error(f"found '{lit}', expected: ')'")
        return values

    def identifiers(self) -> list[str]:
        values: list[str] = []
        while True:
            tok, lit = self.consume()
            if tok == _IDENT:
                values.append(lit)
                tok2, lit2 = self.lookahead()
                if tok2 == ")":
                    return values
                if tok2 != ",":
                    raise _Error(f"found '{lit2}', expected: ',' or ')'")
            elif tok == ",":  # "(,", ",,", ",)": empty values
                if not values:
                    values.append("")
                tok2 = self.lookahead()[0]
                if tok2 == ")":
                    values.append("")
                    return values
                if tok2 == ",":
                    self.consume()
                    values.append("")
            else:
                raise _Error(f"found '{lit}', expected: ',', or identifier")

    def exact_value(self) -> list[str]:
        if self.lookahead()[0] in (_END, ","):
            return [""]  # `a=`: the empty value
        tok, lit = self.consume()
        if tok != _IDENT:
            raise _Error(f"found '{lit}', expected: identifier")
        return [lit]


def _matches(labels: Mapping[str, str], key: str, op: str, values: list[str]) -> bool:
    """labels.Requirement.Matches."""
    if op in ("=", "==", "in"):
        return key in labels and labels[key] in values
    if op in ("!=", "notin"):
        return key not in labels or labels[key] not in values
    if op == "exists":
        return key in labels
    if op == "!":
        return key not in labels
    have = labels.get(key)  # > and <: an integer label only
    if have is None or not _INT64.fullmatch(have):
        return False
    return int(have) > int(values[0]) if op == ">" else int(have) < int(values[0])


def parse(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """The selector as a predicate over a labels mapping (None or "": everything matches).

    Raises:
        ValidationError: kube-apiserver would refuse the selector; the message names it and why.
    """
    try:
        reqs = _Parser(selector or "").parse()
    except _Error as e:
        raise ValidationError(f"invalid label selector {selector!r}: {e} "
                              "(e.g. 'team=ads,tier!=dev', 'tier in (gold,silver)', '!canary')") from None
    return lambda labels: all(_matches(labels, *req) for req in reqs)

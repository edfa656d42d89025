"""The `gemctl` and `gem` command lines the documentation shows exist, with the options they show.

Every `gemctl ...` and `gem train|distill|eval|serve-precompute ...` in a code block or an inline
code span of README.md and docs/*.md, in the comments of examples/*.yaml, in the Makefile and in
the chart's NOTES.txt must name a real subcommand, and each `-x` / `--xyz` after it must be an
option of that subcommand (`gemctl --local list` is not: `--local` is an option of each command).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import typer.main

from gem_sdk.cli import app

ROOT = Path(__file__).resolve().parents[1]

# A command line ends at a shell operator, a comment, a redirect, a closing parenthesis, or a wide
# gap before a description (a synopsis's second column); " | " before an option is an alternative.
_END = re.compile(r"&&|\|\||;|\s#|\s\d?>|\)|\s\|\s(?!-)|\s{3,}(?=[a-z(])|\s/\s")
_OPTION = re.compile(r"^-{1,2}[A-Za-z][\w-]*")


def _code_snippets(path: Path) -> list[str]:
    """Code as a reader would copy it: fenced and indented blocks, inline spans, YAML comments."""
    text = path.read_text()
    if path.suffix == ".yaml":
        return [line.lstrip("# ") for line in text.splitlines() if line.lstrip().startswith("#")]
    if path.suffix != ".md":
        return text.splitlines()
    snippets, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            snippets.append(line)
        else:
            prose.append(line)
    snippets += re.findall(r"`([^`]+)`", " ".join(prose))
    return snippets


def _invocations(snippet: str, program: str) -> list[list[str]]:
    """The argument lists of each `program ...` in a snippet, up to where that command line ends."""
    out = []
    for m in re.finditer(rf"(?:^|(?<=[\s/(]))(?:\$\s*)?{re.escape(program)}\s+(.*)", snippet):
        args = _END.split(m.group(1))[0].split()
        if args:
            out.append(args)
    return out


def _doc_files() -> list[Path]:
    return ([ROOT / "README.md", ROOT / "Makefile", ROOT / "helm/gem-platform/templates/NOTES.txt"]
            + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "examples").glob("*.yaml")))


def _options(args: list[str]) -> list[str]:
    found = []
    for arg in args:
        arg = arg.strip("[]'\",.")
        m = _OPTION.match(arg)
        if m and arg != "-":
            found.append(m.group(0))
    return found


def _gemctl_options() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {name: {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
            for name, cmd in group.commands.items()}


def _gem_options() -> dict[str, set[str]]:
    from gem.cli import main

    options = {}
    for sub in ("train", "distill", "eval", "serve-precompute"):
        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
            main([sub, "--help"])
        options[sub] = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text.getvalue()))
    return options


def test_documented_gemctl_commands_and_options_exist():
    commands = _gemctl_options()
    seen, wrong = 0, []
    for path in _doc_files():
        for snippet in _code_snippets(path):
            for args in _invocations(snippet, "gemctl"):
                where = f"{path.relative_to(ROOT)}: gemctl {' '.join(args)}"
                if not re.search(r"[a-z]", args[0]):  # a placeholder: `gemctl COMMAND --local`, `gemctl ...`
                    continue
                seen += 1
                if args[0] not in commands:
                    wrong.append(f"{where}: no command {args[0]!r} (commands: {', '.join(sorted(commands))})")
                    continue
                wrong += [f"{where}: gemctl {args[0]} has no option {opt}"
                          for opt in _options(args[1:]) if opt not in commands[args[0]]]
    assert seen > 20, "the documentation's gemctl lines were not found"
    assert not wrong, "\n".join(wrong)


def test_documented_gem_commands_and_options_exist():
    commands = _gem_options()
    seen, wrong = 0, []
    for path in _doc_files():
        for snippet in _code_snippets(path):
            for args in _invocations(snippet, "gem"):
                if args[0] not in commands:
                    continue  # prose such as `gem` CLI, or another program's argument
                seen += 1
                wrong += [f"{path.relative_to(ROOT)}: gem {' '.join(args)}: gem {args[0]} has no option {opt}"
                          for opt in _options(args[1:]) if opt not in commands[args[0]]]
    assert seen > 5, "the documentation's gem lines were not found"
    assert not wrong, "\n".join(wrong)

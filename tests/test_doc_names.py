"""The docs name only what exists: every `ddtree_gen.` dotted name in README.md and docs/*.md resolves (by importing
it, so a module that moves or a function that is renamed fails here), and every link between the pages (a file of
the repository, and its #anchor where one is given) points at something that is there."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

DOTTED = re.compile(r"(?<![\w.])ddtree_gen(?:\.[A-Za-z_]\w*)+")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
# packages a module of ddtree_gen may need that the README's test install does not have (extras)
OPTIONAL = {"torch", "transformers", "flash_mla", "cupy", "cupy_backends", "triton"}


def _optional_missing(e: ImportError) -> bool:
    return isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OPTIONAL


def _defined_at_top(path: Path, name: str) -> bool:
    """Whether module file `path` defines `name` at its top level (a def, class, assignment or import): the check for
    a module that cannot be imported here for want of an optional package."""
    import ast
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name).split(".")[0] == name for a in node.names):
                return True
    return False


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def resolve(dotted: str) -> str | None:
    """None where `dotted` (ddtree_gen.a.b.c) names something that exists, else why not: the longest prefix that is a
    module is imported, the rest looked up as attributes. A module that needs an optional package absent here is
    read instead: the first attribute must be defined at its top level."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        name = ".".join(parts[:i])
        if _module_file(name) is None:
            i -= 1
            continue
        try:
            obj = importlib.import_module(name)
        except ImportError as e:
            if not _optional_missing(e):
                return f"import {name}: {e}"
            if i == len(parts):
                return None
            return None if _defined_at_top(_module_file(name), parts[i]) else \
                f"{name} (not importable here: {e.name} absent) defines no {parts[i]!r}"
        break
    if obj is None:
        return f"no module {parts[0]}"
    for j in range(i, len(parts)):
        try:
            obj = getattr(obj, parts[j])
        except AttributeError:
            sub = ".".join(parts[:j + 1])
            return f"{'.'.join(parts[:j])} has no attribute {parts[j]!r}" + \
                (f" (and {sub} is no module)" if _module_file(sub) is None else "")
    return None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lower case, every character but letters, digits, spaces,
    hyphens and underscores removed, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link's text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set:
    """The anchors of a page: its headings' slugs (outside code blocks; a repeated heading gets -1, -2 ...) and any
    explicit <a id="..."> / <a name="...">."""
    out, seen = set(), {}
    for m in HEADING.finditer(FENCE.sub("", text)):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out | set(HTML_ANCHOR.findall(text))


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def name_problems(text: str, where: str) -> list[str]:
    """Every `ddtree_gen.` dotted name of `text` that does not resolve, as 'where:line: name: why'."""
    out, done = [], {}
    for m in DOTTED.finditer(text):
        name = m.group(0)
        if name not in done:
            done[name] = resolve(name)
        if done[name]:
            out.append(f"{where}:{_line(text, m.start())}: {name}: {done[name]}")
    return out


def link_problems(text: str, page: Path) -> list[str]:
    """Every link of `text` (a page at `page`, code blocks left out) to a repository file that is not there, or to
    an #anchor that page does not have. Links out of the repository (a scheme: https:, mailto:) are not checked."""
    out = []
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)   # the same line numbers
    prose = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), prose)   # inline code is no link
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{page.relative_to(REPO)}:{_line(prose, m.start())}: ({target})"
        if not path_part:   # an anchor of this page
            if anchor not in anchors(text):
                out.append(f"{where}: {page.name} has no anchor #{anchor}")
            continue
        dest = (page.parent / path_part).resolve()
        if not dest.exists():
            out.append(f"{where}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"{where}: {dest.name} has no anchor #{anchor}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_dotted_name_exists(page):
    problems = name_problems(page.read_text(), str(page.relative_to(REPO)))
    assert not problems, "names that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_pages_exists(page):
    problems = link_problems(page.read_text(), page)
    assert not problems, "links to nothing:\n" + "\n".join(problems)


def test_a_stale_name_and_a_broken_link_are_found(tmp_path):
    """The checks themselves: a function that was never there, a module that is not, a file and an anchor that are
    not; and what exists passes (a function, a record's field, a module needing no optional package)."""
    text = ("size it with `ddtree_gen.ops.tree_verify.mma.workspace_elems(spec, B)` or\n"
            "ddtree_gen.no_such_module.f; ddtree_gen.kernel_set.KernelSet.tree_verify_schedule and\n"
            "ddtree_gen.types.TreeBuildOutput.tree_mask exist, as does ddtree_gen.reference.\n")
    problems = name_problems(text, "page.md")
    assert len(problems) == 2, problems
    assert problems[0].startswith("page.md:1: ddtree_gen.ops.tree_verify.mma.workspace_elems: "
                                  "ddtree_gen.ops.tree_verify.mma has no attribute 'workspace_elems'"), problems
    assert problems[1].startswith("page.md:2: ddtree_gen.no_such_module.f: ddtree_gen has no attribute "
                                  "'no_such_module' (and ddtree_gen.no_such_module is no module)"), problems
    page = REPO / "docs" / "page.md"   # as if it were one of docs/ (the file need not exist: its links are read)
    text = ("# A page\n## tree_verify's route (`impl`)\n[ok](usage.md) [ok](../README.md#python-api) "
            "[ok](#a-page) [ok](#tree_verifys-route-impl)\n[bad](nowhere.md) [bad](usage.md#no-such-heading) [bad](#b)\n"
            "```\n[in code](nowhere.md)\n```\n[out](https://example.com/x.md)\n")
    problems = [p.split("): ", 1)[1] for p in link_problems(text, page)]
    assert problems == ["no file docs/nowhere.md", "usage.md has no anchor #no-such-heading",
                        "page.md has no anchor #b"], problems


def test_a_module_that_needs_an_absent_extra_is_read_instead(monkeypatch):
    """Where a module cannot be imported for want of an optional package (torch on the README's test install), its
    top-level names are read from its source: what it defines resolves, what it does not is still found."""
    import sys
    real = importlib.import_module

    def no_torch(name, *a):
        if name == "ddtree_gen.torch_api":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *a)
    monkeypatch.setattr(importlib, "import_module", no_torch)
    monkeypatch.delitem(sys.modules, "ddtree_gen.torch_api", raising=False)
    assert resolve("ddtree_gen.torch_api.load") is None
    assert resolve("ddtree_gen.torch_api.TorchKernels.tree_build") is None   # its first attribute is what is read
    assert "defines no 'no_such_name'" in resolve("ddtree_gen.torch_api.no_such_name")

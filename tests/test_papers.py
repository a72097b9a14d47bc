"""Every paper citation in the package points into docs/papers.md: a "§" names its paper (on its
own line or the line before), the paper is one docs/papers.md defines, and the section is in
that paper's table there, so a reader can find which version's section the code means."""

import re
from pathlib import Path

import gouache

ROOT = Path(gouache.__file__).parent
PAPERS = ROOT.parent / "docs" / "papers.md"

SHORT_NAME = re.compile(r"^- \*\*Short name in code:\*\* `([^`]+)`", re.M)
ROW = re.compile(r"^\| §(\d+(?:\.\d+)*) \|")
# "§4.2", "§ 4.2.1", "§3-4" (a range: both ends are checked)
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
# a name in CamelCase or capitals directly before a "§" ("InstGenIE §3.1", "KATZ's §6") is
# meant as a paper's
NAMED_BEFORE = re.compile(r"\b([A-Z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*|[A-Z]{3,})(?:'s)?\s*§")


def papers() -> dict[str, set[str]]:
    """Short name -> the sections its table in docs/papers.md lists."""
    table: dict[str, set[str]] = {}
    name = None
    for line in PAPERS.read_text().splitlines():
        if match := SHORT_NAME.match(line):
            name = match.group(1)
            table[name] = set()
        elif name and (match := ROW.match(line)):
            table[name].add(match.group(1))
    return table


def names_in(text: str, names: set[str]) -> list[str]:
    """The short names in `text`, in order, as whole words."""
    pattern = r"(?<![\w-])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?![\w-])"
    return re.findall(pattern, text)


def citations(names: set[str]) -> list[tuple[str, int, str | None, str, str]]:
    """(file, line number, paper or None, section, the line) for every section of every "§" in the
    package. The paper is the last short name before the "§" on its line, else the last one on
    the line before."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for match in SECTION.finditer(line):
                before = names_in(line[: match.start()], names) or (names_in(lines[i - 1], names) if i else [])
                paper = before[-1] if before else None
                for section in filter(None, match.groups()):
                    found.append((str(path.relative_to(ROOT.parent)), i + 1, paper, section, line.strip()))
    return found


def test_papers_md_defines_the_four_papers():
    table = papers()
    assert {"PatchedServe", "InstGenIE", "TetriServe", "KATZ"} <= set(table)
    assert all(table[name] for name in ("PatchedServe", "InstGenIE", "TetriServe", "KATZ"))


def test_every_section_sign_names_its_paper():
    bare = [f"{file}:{n}: {line}" for file, n, paper, _, line in citations(set(papers())) if paper is None]
    assert not bare, "a § with no paper named on its line or the line before:\n" + "\n".join(bare)


def test_cited_sections_are_in_papers_md():
    table = papers()
    missing = [f"{file}:{n}: {paper} §{section} (docs/papers.md lists {sorted(table[paper])})"
               for file, n, paper, section, _ in citations(set(table))
               if paper is not None and section not in table[paper]]
    assert not missing, "sections docs/papers.md does not list:\n" + "\n".join(missing)


def test_names_before_a_section_sign_are_papers_md_papers():
    names = set(papers())
    unknown = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            unknown += [f"{path.relative_to(ROOT.parent)}:{n}: {match.group(1)}"
                        for match in NAMED_BEFORE.finditer(line) if match.group(1) not in names]
    assert not unknown, "cited papers docs/papers.md does not define:\n" + "\n".join(unknown)


def test_paper_names_are_spelled_as_papers_md_spells_them():
    """"Katz" or "Tetriserve" in prose would dodge the checks above; an all-lowercase name is an
    identifier or a file name (`exp_instgenie`, "tetriserve.json") and is left alone."""
    names = set(papers())
    lower = {name.lower(): name for name in names}
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, lower)) + r")(?![\w-])", re.I)
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            wrong += [f"{path.relative_to(ROOT.parent)}:{n}: {word} (papers.md: {lower[word.lower()]})"
                      for word in pattern.findall(line) if word not in names and not word.islower()]
    assert not wrong, "paper names spelled otherwise than in docs/papers.md:\n" + "\n".join(wrong)

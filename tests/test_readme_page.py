"""The README is a page a newcomer reads in five minutes, and nothing it dropped is lost:
- up to "Where things are" it stays under 120 lines;
- every file it links or names as a README exists;
- every benchmark row names a script that exists and has its section in benchmarks/README.md,
  with the command and every figure the row shows in bold."""

import re

from tests.support.engines import REPO

README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "benchmarks" / "README.md").read_text()
TOP_LINES = 120


def benchmark_rows(text: str) -> list[tuple[str, list[str]]]:
    """(script name, bold figures) of each row of the README's Benchmarks table."""
    table = text[text.index("## Benchmarks"):]
    table = table[:table.index("\n## ", 5)] if "\n## " in table[5:] else table
    rows = []
    for line in table.splitlines():
        script = re.search(r"`benchmarks/(\w+)\.py", line)
        if line.startswith("| ") and script:
            figures = re.findall(r"\*\*([^*]+)\*\*", line.split(" | ")[-1])
            rows.append((script.group(1), figures))
    return rows


def section(text: str, name: str) -> str:
    start = text.index(f"\n## {name}\n")
    end = text.find("\n## ", start + 4)
    return text[start:end if end != -1 else None]


def test_the_top_page_is_short():
    top = README[:README.index("## Where things are")]
    assert len(top.splitlines()) < TOP_LINES


def test_every_linked_file_exists():
    linked = set(re.findall(r"\]\(([^)#:]+)\)", README)) | set(re.findall(r"`([\w./-]+README\.md)`", README))
    assert linked, "the README links nothing"
    assert sorted(p for p in linked if not (REPO / p).exists()) == []


def test_every_benchmark_row_has_its_section_with_command_and_figures():
    rows = benchmark_rows(README)
    assert len(rows) >= 7
    missing = []
    for script, figures in rows:
        assert (REPO / "benchmarks" / f"{script}.py").is_file(), script
        text = section(BENCHMARKS, script)
        assert f"benchmarks/{script}.py" in text, f"benchmarks/README.md, {script}: no command"
        missing += [(script, f) for f in figures if f not in text]
    assert missing == []


def test_the_row_reader_sees_a_dropped_figure():
    fake = "## Benchmarks\n\n| what | command | figure |\n|---|---|---|\n| x | `benchmarks/grammar_cost.py` | **9.99x** |\n"
    rows = benchmark_rows(fake)
    assert rows == [("grammar_cost", ["9.99x"])]
    assert "9.99x" not in section(BENCHMARKS, "grammar_cost")

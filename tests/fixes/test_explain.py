"""`apply_all.py --explain`: where a refused anchor went, never a fuzzy apply.

Two trees, the same four drifts (an anchor edited, moved to another file, duplicated, deleted):
- a small synthetic package with its own profile and units, written to tmp_path, run through the
  real `apply_all.main` (runs everywhere, so CI exercises the code);
- copies of the vllm-gaudi tree named by GAUDI_FIXES_ROOT with a real unit's anchor drifted
  (skipped with the reason when it is unset).
Each checks the file and line range the report names, that the diff shows the drift, and that
nothing was written.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from fixes import apply_all
from fixes.engine import EXIT_IMAGE, EXIT_NOT_APPLIED, EXIT_REFUSED, run
from fixes.explain import CLOSE, explain
from fixes.profile import load_profile
from tests.support.gaudi.fix_trees import tree_digest
from tests.support.gaudi.tree import copy_tree


# ------------------------------------------------------------------ the synthetic package

RUNNER = '''\
"""A toy runner: the target of the toy units."""


class Runner:
    def prepare(self, tables, window):
        limit = window // 4
        kept = [t[-limit:] for t in tables]
        return kept

    def mask(self, usage, size):
        slots = list(range(size))
        return [s >= usage for s in slots]


def helper(x):
    return x + 1
'''
OTHER = '''\
"""Another module of the toy package."""


def unrelated(values):
    return sorted(values)
'''
KEPT = "        kept = [t[-limit:] for t in tables]\n"
UNITS = {
    "toy-first": ('''
        slots = list(range(size))
''', '''
        slots = list(range(size))  # beam-hpu fix toy-first: the slots, counted once
'''),
    "toy-window": ("\n" + KEPT, "\n" + KEPT + '''\
        # beam-hpu fix toy-window: keep one block more than the window needs
        kept = [t[-limit - 1:] for t in tables]
'''),
}
# A unit whose anchor is text toy-first writes: it can only apply after it.
LATER = ("toy-later", '''
        slots = list(range(size))  # beam-hpu fix toy-first: the slots, counted once
''', '''
        slots = list(range(size))  # beam-hpu fix toy-first: the slots, counted once
        slots.reverse()  # beam-hpu fix toy-later: newest first
''')


def unit_toml(name: str, anchor: str, replacement: str) -> str:
    fields = "\n".join(f'{f} = "{f} of {name}"' for f in
                       ("why", "changes", "applied_when", "remove_when", "upstream"))
    scope = f'scope = "global: a toy fix, harmless by tests/fixes/test_explain.py"'
    return (f'name = "{name}"\npackage = "toypkg"\n{fields}\n{scope}\n\n[[edits]]\n'
            f'file = "toypkg/runner.py"\nanchor = """{anchor}"""\nreplacement = """{replacement}"""\n')


@pytest.fixture
def toy(tmp_path):
    """(root holding toypkg/, the profiles dir): toypkg 1.0 at commit abc1234, profile `toy`."""
    root = tmp_path / "site"
    (root / "toypkg").mkdir(parents=True)
    (root / "toypkg" / "__init__.py").write_text("")
    (root / "toypkg" / "_version.py").write_text('version = "1.0+gabc1234"\n')
    (root / "toypkg" / "runner.py").write_text(RUNNER)
    (root / "toypkg" / "other.py").write_text(OTHER)
    units, profiles = tmp_path / "units", tmp_path / "profiles"
    units.mkdir()
    profiles.mkdir()
    for name, (anchor, replacement) in [*UNITS.items(), (LATER[0], LATER[1:])]:
        (units / f"{name}.toml").write_text(unit_toml(name, *(anchor, replacement)))
    (profiles / "toy.toml").write_text(
        f'description = "toy"\nunits_dir = "{units}"\nfixes = ["toy-first", "toy-window", "toy-later"]\n'
        '[packages.toypkg]\ndistributions = ["toypkg"]\nversion = "1.0"\ncommit = "abc1234"\n')
    return root, profiles


def explain_cli(capsys, root: Path, profiles: Path, *extra: str) -> tuple[int, str]:
    code = apply_all.main(["--profile", "toy", "--profiles-dir", str(profiles),
                           "--root", f"toypkg={root}", *extra])
    return code, capsys.readouterr().out


def edit_runner(root: Path, old: str, new: str) -> None:
    path = root / "toypkg" / "runner.py"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))


def line_of(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


def test_explain_alone_checks_and_never_writes(toy, capsys):
    root, profiles = toy
    before = tree_digest(root)
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_NOT_APPLIED  # --check's exit code: nothing refused, nothing applied yet
    assert "toy-window: not applied" in out and "explain: no refused edit" in out
    assert tree_digest(root) == before
    assert explain_cli(capsys, root, profiles)[0] == 0  # a real run applies all three
    code, out = explain_cli(capsys, root, profiles, "--check", "--explain")
    assert code == 0 and "toy-window: already applied" in out


def test_edited_anchor_names_the_line_and_diffs_the_edit(toy, capsys):
    root, profiles = toy
    edited = "        kept = [table[-limit:] for table in tables]\n"
    edit_runner(root, KEPT, edited)
    before = tree_digest(root)
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    assert "toy-window: refused: toypkg/runner.py (edit 1): anchor not found" in out
    line = line_of(RUNNER, KEPT)
    assert f"most similar region: toypkg/runner.py:{line} (in Runner.prepare) ratio" in out
    assert "\n    -" + KEPT.rstrip("\n") + "\n" in out  # the diff: anchor vs what is there
    assert "\n    +" + edited.rstrip("\n") + "\n" in out
    assert "no marker 'beam-hpu fix toy-window' in toypkg/runner.py" in out
    assert tree_digest(root) == before


def test_moved_anchor_names_the_other_file(toy, capsys):
    root, profiles = toy
    edit_runner(root, KEPT, "        kept = keep_window(tables, limit)\n")
    moved = "\n\ndef keep_window(tables, limit):\n    " + KEPT.lstrip() + "    return kept\n"
    (root / "toypkg" / "other.py").write_text(OTHER + moved)
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    line = line_of(OTHER + moved, "kept = [t[-limit:]")
    assert f"anchor moved to toypkg/other.py:{line} (in keep_window) ratio 1.00" in out


def test_renamed_file_is_found_by_its_anchor(toy, capsys):
    root, profiles = toy
    (root / "toypkg" / "runner.py").rename(root / "toypkg" / "engine.py")
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    assert "toy-window: refused: toypkg/runner.py: no such file" in out
    line = line_of(RUNNER, KEPT)
    assert f"anchor moved to toypkg/engine.py:{line} (in Runner.prepare) ratio 1.00" in out
    [found] = [explain(r) for r in run(load_profile("toy", profiles), roots={"toypkg": str(root)},
                                       check=True).refused_edits if r.fix == "toy-window"]
    assert found.summary() == ("toy-window edit 1: no file toypkg/runner.py; "
                               f"anchor moved to toypkg/engine.py:{line} (in Runner.prepare)")


def test_duplicated_anchor_lists_every_place(toy, capsys):
    root, profiles = toy
    copy = "\n\nclass Copy:\n    def prepare(self, tables, limit):\n" + KEPT + "        return kept\n"
    path = root / "toypkg" / "runner.py"
    path.write_text(RUNNER + copy)
    text = path.read_text()
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    assert "toy-window: refused: toypkg/runner.py (edit 1): anchor found 2 times" in out
    first, second = line_of(text, KEPT), text.rindex(KEPT)
    second = text[:second].count("\n") + 1
    assert f"anchor at toypkg/runner.py:{first} (in Runner.prepare)" in out
    assert f"anchor at toypkg/runner.py:{second} (in Copy.prepare)" in out


def test_deleted_anchor_says_no_close_match(toy, capsys):
    root, profiles = toy
    edit_runner(root, KEPT, "")
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    assert "most similar region: toypkg/runner.py:" in out
    assert "(weak: the anchor's text may be gone)" in out
    assert "\n    -" + KEPT.rstrip("\n") + "\n" in out


def test_older_form_of_the_fix_is_reported(toy, capsys):
    root, profiles = toy
    older = ("        # beam-hpu fix toy-window: an earlier text of this fix\n"
             "        kept = [t[-limit:] for t in tables][:]\n")
    edit_runner(root, KEPT, older)
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    text = (root / "toypkg" / "runner.py").read_text()
    marker = line_of(text, "# beam-hpu fix toy-window")
    assert f"marker 'beam-hpu fix toy-window' present at toypkg/runner.py:{marker} (in Runner.prepare)" in out
    assert "closest to this edit's replacement: toypkg/runner.py:" in out
    assert "\n    -        kept = [t[-limit - 1:] for t in tables]\n" in out  # replacement vs older


def test_anchor_written_by_a_refused_earlier_fix_names_it(toy, capsys):
    root, profiles = toy
    edit_runner(root, "        slots = list(range(size))\n", "        slots = [*range(size)]\n")
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_REFUSED
    assert "toy-later: refused" in out
    assert ("the anchor's lines 'slots = list(range(size))  # beam-hpu fix toy-first: the slots, "
            "counted once' are written by fix toy-first, which did not apply here") in out


def test_explain_after_an_image_refusal_plans_nothing(toy, capsys):
    root, profiles = toy
    (root / "toypkg" / "_version.py").write_text('version = "1.0+gdef5678"\n')
    code, out = explain_cli(capsys, root, profiles, "--explain")
    assert code == EXIT_IMAGE
    assert "explain: nothing planned (the image check refused the trees)" in out


# ------------------------------------------------------------------ the public vllm-gaudi tree

GAUDI_PROFILE = "v0.30.0-public-main"
GAUDI_FIX = "swa-decode-window"
GAUDI_EDIT = 4  # `mask = mask >= block_usage.unsqueeze(-1)` in _set_block_mapping


@pytest.fixture
def gaudi(tmp_path):
    root, checkouts = copy_tree(tmp_path / "site")
    unit = next(u for u in load_profile(GAUDI_PROFILE).fixes if u.name == GAUDI_FIX)
    edit = unit.edits[GAUDI_EDIT - 1]
    return root, checkouts, edit, root / edit.file


def gaudi_explain(root: Path, checkouts) -> list:
    report = run(load_profile(GAUDI_PROFILE), roots={"vllm_gaudi": str(root)}, checkouts=checkouts,
                 only=[GAUDI_FIX], check=True)
    assert report.exit_code == EXIT_REFUSED, report.lines
    units = [u.name for u in load_profile(GAUDI_PROFILE).fixes]
    return [explain(r, load_profile(GAUDI_PROFILE).fixes[:units.index(r.fix)])
            for r in report.refused_edits]


@pytest.mark.gaudi_tree
def test_gaudi_edited_anchor(gaudi):
    root, checkouts, edit, path = gaudi
    text = path.read_text()
    edited = edit.anchor.replace("block_usage.unsqueeze(-1)", "block_usage.view(-1, 1)")
    path.write_text(text.replace(edit.anchor, edited))
    before = tree_digest(root)
    [found] = gaudi_explain(root, checkouts)
    line = line_of(text, edit.anchor.strip("\n"))
    assert (found.fix, found.index, found.nearest.file) == (GAUDI_FIX, GAUDI_EDIT, edit.file)
    assert (found.nearest.first, found.nearest.last) == (line, line)
    assert found.nearest.scope.endswith("_set_block_mapping")
    report = "\n".join(found.report())
    assert "+        mask = mask >= block_usage.view(-1, 1)" in report
    assert "-        mask = mask >= block_usage.unsqueeze(-1)" in report
    assert tree_digest(root) == before


@pytest.mark.gaudi_tree
def test_gaudi_moved_anchor(gaudi):
    root, checkouts, edit, path = gaudi
    path.write_text(path.read_text().replace(edit.anchor, "\n        mask = _moved(mask, block_usage)\n"))
    other = root / "vllm_gaudi" / "extension" / "utils.py"
    moved = "\n\ndef _moved(mask, block_usage):\n    " + edit.anchor.strip() + "\n    return mask\n"
    other.write_text(other.read_text() + moved)
    [found] = gaudi_explain(root, checkouts)
    line = other.read_text().count("\n") - 1  # the line before the return
    assert [(r.file, r.first, r.last, r.scope) for r in found.elsewhere] == [
        ("vllm_gaudi/extension/utils.py", line, line, "_moved")]
    assert "anchor moved to vllm_gaudi/extension/utils.py" in found.summary()


@pytest.mark.gaudi_tree
def test_gaudi_duplicated_anchor(gaudi):
    root, checkouts, edit, path = gaudi
    text = path.read_text() + "\n\nif 0:\n\n    def _copy(mask, block_usage):" + edit.anchor
    path.write_text(text)
    [found] = gaudi_explain(root, checkouts)
    first = line_of(text, edit.anchor.strip("\n"))
    last = text[:text.rindex(edit.anchor.strip("\n"))].count("\n") + 1
    assert [(r.file, r.first) for r in found.occurrences] == [(edit.file, first), (edit.file, last)]
    assert [r.scope.rsplit(".", 1)[-1] for r in found.occurrences] == ["_set_block_mapping", "_copy"]
    assert f"anchor found 2 times: {edit.file}:{first} (in " in found.summary()


@pytest.mark.gaudi_tree
def test_gaudi_deleted_anchor(gaudi):
    root, checkouts, edit, path = gaudi
    path.write_text(path.read_text().replace(edit.anchor, "\n"))
    [found] = gaudi_explain(root, checkouts)
    assert found.nearest.file == edit.file and found.nearest.ratio < 1.0
    assert found.best().ratio < CLOSE, found.summary()
    assert "no close match" in found.summary()
    assert "-        mask = mask >= block_usage.unsqueeze(-1)" in "\n".join(found.report())


def test_every_refused_edit_of_a_fix_is_explained(toy, capsys):
    """The fix is refused on its first refused edit; --explain still reports the later ones."""
    root, profiles = toy
    units = profiles.parent / "units"
    two = unit_toml("toy-two", "\n" + KEPT, "\n" + KEPT + "        # beam-hpu fix toy-two: one\n")
    two += ('\n[[edits]]\nfile = "toypkg/runner.py"\nanchor = """\n    return x + 1\n"""\n'
            'replacement = """\n    return x + 1  # beam-hpu fix toy-two: two\n"""\n')
    (units / "toy-two.toml").write_text(two)
    (profiles / "two.toml").write_text(
        f'description = "two"\nunits_dir = "{units}"\nfixes = ["toy-two"]\n'
        '[packages.toypkg]\ndistributions = ["toypkg"]\nversion = "1.0"\ncommit = "abc1234"\n')
    edit_runner(root, KEPT, "        kept = [t[-limit:] for t in tables if t]\n")
    edit_runner(root, "    return x + 1\n", "    return x + 2\n")
    code = apply_all.main(["--profile", "two", "--profiles-dir", str(profiles),
                           "--root", f"toypkg={root}", "--explain"])
    out = capsys.readouterr().out
    assert code == EXIT_REFUSED
    assert "toy-two: refused: toypkg/runner.py (edit 1): anchor not found" in out
    assert "explain toy-two edit 1 (toypkg/runner.py)" in out
    assert "explain toy-two edit 2 (toypkg/runner.py)" in out
    assert f"most similar region: toypkg/runner.py:{line_of(RUNNER, '    return x + 1')} (in helper)" in out

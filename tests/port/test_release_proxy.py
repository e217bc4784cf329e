"""How the release proxy is built (tests/support/release_proxy.py), on small git directories made
here: PRs merged in the data file's order, those in the base skipped, missing ones recorded, the
same inputs giving the same commit, a conflict refused by the PR's name with nothing left behind
unless the data file resolves that file; and the data file itself against the release notes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fixes.profile import load_profile
from tests.support.release_proxy import (CHANGELOG, PROXY_NAME, ProxyError, build_release_proxy, read_changelog,
                                         read_manifest)

IDENTITY = ["-c", "user.name=t", "-c", "user.email=t@t"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *IDENTITY, *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, files: dict[str, str], subject: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", subject)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def upstream(tmp_path):
    """A vllm-gaudi-like repository: a base holding PR 3, and PRs 1 and 2 as refs/pull/N/head."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, {"vllm_gaudi/__init__.py": "", "vllm_gaudi/ops.py": "a = 1\nb = 2\n"}, "start")
    base = commit(repo, {"vllm_gaudi/three.py": "three = 3\n"}, "Add three (#3)")
    heads = {}
    for number, files in ((1, {"vllm_gaudi/ops.py": "a = 10\nb = 2\n"}), (2, {"vllm_gaudi/two.py": "two = 2\n"}),
                          (5, {"vllm_gaudi/ops.py": "a = 50\nb = 2\n"})):
        git(repo, "checkout", "-q", "-b", f"pr{number}", base)
        heads[number] = commit(repo, files, f"pr {number}")
        git(repo, "update-ref", f"refs/pull/{number}/head", heads[number])
    git(repo, "checkout", "-q", "main")
    return repo, base, heads


def changelog(path: Path, base: str, entries: list[str]) -> Path:
    path.write_text(f'base = "{base}"\nrelease = "0000000"\nnotes = "x"\n' + "".join(entries))
    return path


def entry(number: int, status: str, head: str = "", extra: str = "") -> str:
    return (f'[[prs]]\nnumber = {number}\ntitle = "change {number}"\nstatus = "{status}"\n'
            + (f'head = "{head}"\n' if head else "") + extra)


def test_merges_in_order_skips_the_base_records_the_missing_and_is_reproducible(upstream, tmp_path):
    repo, base, heads = upstream
    data = changelog(tmp_path / "log.toml", base, [entry(3, "in_base"), entry(2, "ref", heads[2]),
                                                     entry(4, "missing"), entry(1, "ref", heads[1])])
    tree = build_release_proxy(repo, tmp_path / "a", data)
    manifest = read_manifest(tmp_path / "a")
    assert (manifest["in_base"], manifest["merged"], manifest["missing"]) == ([3], [2, 1], [4])
    subjects = git(tree, "log", "--first-parent", "--format=%s", f"{base}..HEAD").splitlines()
    assert subjects == ["release proxy: merge vllm-gaudi #1 (change 1)", "release proxy: merge vllm-gaudi #2 (change 2)"]
    assert (tree / "vllm_gaudi/ops.py").read_text() == "a = 10\nb = 2\n" and (tree / "vllm_gaudi/two.py").is_file()
    again = build_release_proxy(repo, tmp_path / "b", data)
    assert git(again, "rev-parse", "HEAD") == manifest["head"] == git(tree, "rev-parse", "HEAD")


def test_a_conflict_refuses_naming_the_pr_and_leaves_nothing(upstream, tmp_path):
    repo, base, heads = upstream
    data = changelog(tmp_path / "log.toml", base, [entry(1, "ref", heads[1]), entry(5, "ref", heads[5])])
    with pytest.raises(ProxyError, match=r"#5 'change 5'.*conflicts in vllm_gaudi/ops.py"):
        build_release_proxy(repo, tmp_path / "c", data)
    assert not (tmp_path / "c" / PROXY_NAME).exists() and not list((tmp_path / "c").glob(".*.partial"))
    assert not (tmp_path / "c" / f"{PROXY_NAME}.json").exists()


def test_a_resolved_conflict_keeps_the_named_side_and_is_recorded(upstream, tmp_path):
    repo, base, heads = upstream
    resolve = 'resolve = { keep = "ours", files = ["vllm_gaudi/ops.py"] }\n'
    data = changelog(tmp_path / "log.toml", base, [entry(1, "ref", heads[1]), entry(5, "ref", heads[5], resolve)])
    tree = build_release_proxy(repo, tmp_path / "d", data)
    assert (tree / "vllm_gaudi/ops.py").read_text() == "a = 10\nb = 2\n"
    assert read_manifest(tmp_path / "d")["resolved"] == {"5": ["vllm_gaudi/ops.py"]}


def test_a_pinned_head_the_ref_moved_away_from_is_refused(upstream, tmp_path):
    repo, base, heads = upstream
    data = changelog(tmp_path / "log.toml", base, [entry(2, "ref", "1" * 40)])
    with pytest.raises(ProxyError, match=r"#2 .*refs/pull/2/head is .* not the pinned head 111111111111"):
        build_release_proxy(repo, tmp_path / "e", data)


def test_the_data_file_lists_the_release_notes_changelog():
    log = read_changelog(CHANGELOG)
    numbers = [pr.number for pr in log.prs]
    assert len(numbers) == len(set(numbers)) == 60 and log.base == "091bbadd"
    assert {pr.status for pr in log.prs} <= {"in_base", "ref", "missing"}
    # The release notes' own statements the port README and profile repeat
    assert {1731, 1749, 1666, 1748, 1738, 1730} == {pr.number for pr in log.prs if pr.status == "ref"}
    assert all(len(pr.head) == 40 for pr in log.prs if pr.status == "ref")
    assert all(pr.keep in ("ours", "theirs") and pr.resolve_files for pr in log.prs if pr.keep)
    port = {u.name for u in load_profile("port-beam-1-0").fixes}
    assert all(pr.diverging_unit() in port for pr in log.prs if pr.divergence)
    # In changelog order: oldest first, so #1731 (merged after #1749) comes after it
    assert numbers.index(1749) < numbers.index(1731) and numbers[0] == 1637 and numbers[-1] == 1827
    assert sum(pr.status == "missing" for pr in log.prs) == 25 and sum(pr.status == "in_base" for pr in log.prs) == 29


def test_explain_names_the_merge_that_last_changed_a_region(upstream, tmp_path):
    """What `apply_all --explain` prints beside a refused anchor's similar regions on such a tree."""
    from fixes.explain import newest_change

    repo, base, heads = upstream
    data = changelog(tmp_path / "log.toml", base, [entry(2, "ref", heads[2]), entry(1, "ref", heads[1])])
    ops = build_release_proxy(repo, tmp_path / "f", data) / "vllm_gaudi" / "ops.py"
    assert newest_change(ops, 1, 1).endswith(" release proxy: merge vllm-gaudi #1 (change 1)")
    assert newest_change(ops, 2, 2).endswith(" start")
    assert newest_change(tmp_path / "log.toml", 1, 1) == ""  # not in a git checkout

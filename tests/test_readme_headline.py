"""The README's performance headline is what ``bench/report.py`` makes of the
committed results, so it can never drift from them.

``bench/report.py`` writes the text between the README's
``<!-- headline:start -->`` and ``<!-- headline:end -->`` markers from a full
run's ``bench/results/raw.json``; here the same function runs on the
committed raw JSON (no benchmark is run) and its text must equal the
README's, character for character.  After a new full ``make bench``, commit
the README with the results.
"""

import json
import os

import pytest

from helpers import bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
RAW = os.path.join(BENCH, "results", "raw.json")
README = os.path.join(ROOT, "README.md")


@pytest.fixture(scope="module")
def report():
    return bench_module("report")


def readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def test_committed_results_are_a_full_run():
    with open(RAW, encoding="utf-8") as f:
        facts = json.load(f)["lossscale"]["facts"]
    assert not facts["quick"], "bench/results/raw.json holds a --quick run"


def test_readme_headline_is_generated_from_the_committed_results(report):
    _, headline, _ = report.split_readme(readme())
    want = report.readme_block(report.Report(RAW))
    assert headline == want, (
        "README.md's headline differs from what bench/report.py makes of "
        "bench/results/raw.json; run `python bench/report.py bench/results/raw.json`")


def test_headline_markers_are_one_pair_in_order(report):
    text = readme()
    start, end = text.index(report.HEADLINE_START), text.index(report.HEADLINE_END)
    assert start < end
    for broken in (text.replace(report.HEADLINE_END, ""),
                   text + report.HEADLINE_START + "\n"):
        with pytest.raises(ValueError):
            report.split_readme(broken)


def test_rewriting_keeps_everything_outside_the_markers(report, tmp_path):
    before, _, after = report.split_readme(readme())
    path = tmp_path / "README.md"
    path.write_text(before + "stale numbers\n" + after, encoding="utf-8")
    rep = report.Report(RAW)
    assert report.update_readme(rep, str(path))
    assert path.read_text(encoding="utf-8") == readme()
    assert not report.update_readme(rep, str(path))

"""The README's scorecard is rendered from the committed results, never typed."""
import json

from conftest import ROOT


def test_readme_scorecard_is_the_published_results(cli):
    "`slm-bench readme --check` passes: the README's results section is exactly what results/tiny/scorecard.json renders to."
    checked = cli("readme", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_published_scorecard_counts_add_up():
    "Every published finding has one verdict; the per-paper counts sum to the totals; checks are apart from findings."
    card = json.loads((ROOT / "results" / "tiny" / "scorecard.json").read_text())
    verdicts = ("reproduced", "contradicted", "inconclusive", "not_testable", "without_control")
    assert sum(card["counts"][v] for v in verdicts) == card["counts"]["total"] == len(card["ledger"]["findings"])
    for verdict in (*verdicts, "total"):
        assert sum(paper[verdict] for paper in card["papers"].values()) == card["counts"][verdict]
    shared = sum(check["paper"] == "" for check in card["ledger"]["checks"])  # the shared stages' checks belong to no paper
    assert sum(paper["checks"] for paper in card["papers"].values()) + shared == card["counts"]["checks"] == len(card["ledger"]["checks"])
    assert set(card["papers"]) == {"TinyGSM", "Phi-4", "Llama 2", "Orca 2"}
    assert card["run"]["commit"] and card["run"]["status"] == "ok"


def test_the_table_of_published_runs_is_rendered_from_published_json():
    "The README has the published runs' table, and its newest row is the run the scorecard comes from."
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- published:start -->") == 1 and readme.count("<!-- published:end -->") == 1
    rows = json.loads((ROOT / "results" / "tiny" / "published.json").read_text())
    card = json.loads((ROOT / "results" / "tiny" / "scorecard.json").read_text())
    assert rows[-1]["commit"] == card["run"]["commit"] and rows[-1]["counts"] == card["counts"]
    assert rows[-1]["seeds"] == card["run"]["seeds"] == len(rows[-1]["span_s"])
    assert f"| `{rows[-1]['commit'][:7]}` |" in readme

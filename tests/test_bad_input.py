"""Bad requests get exit code 2, a message that names the problem and the fix, and write nothing."""
import importlib.util

import pytest

from conftest import PIPELINES, ROOT, tree

BASIC = PIPELINES / "basic"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stages", "nope"], "unknown stage 'nope'; stages: environment, synth, curate, mixture, pretrain, sft, chat_sft, preferences, reward_model, rejection_sampling, ppo, gatt, contamination, safety, rlhf_round2, explanations, strategy_choice, orca_sft, orca_evaluate, pts, dpo, workflows, midtrain, hallucination, mixture_ablations, synthetic_epochs, verifier, judge_dpo, evaluate, grid, validated_sft"),
        (["--stages", ","], "--stages needs at least one name, e.g. --stages environment"),
        (["--recipe", "orca3"], "unknown recipe 'orca3'; recipes: common, llama2, orca2, phi4, phi4-ablations, tinygsm, tinygsm-ablations (see `slm-bench recipes`)"),
        (["--recipe", " , "], "--recipe needs at least one name, e.g. --recipe phi4"),
        (["--recipe", "phi4", "--stages", "pts"], "--recipe and --stages choose the stages two ways: pass one of them"),
        (["--profile", "huge"], "unknown profile 'huge'; known profiles: tiny, smoke, gpu"),
        (["--set", "environment.nope=1"], "unknown parameter 'environment.nope'"),
        (["--set", "environment.repetas=3"], "did you mean environment.repeats"),
        (["--set", "nope=1"], "unknown parameter 'nope'"),
        (["--set", "envirnment.repeats=3"], "unknown stage 'envirnment'"),
        (["--set", "environment.repeats=many"], "'many' is not a valid int for parameter repeats"),
        (["--set", "environment.sizes=[64, 'x']"], "is not a valid list[int] for parameter sizes"),
        (["--set", "environment.min_time_s=fast"], "is not a valid float"),
        (["--set", "environment.repeats"], "expected key=value"),
        (["--set", "run_dir=/tmp/elsewhere"], "is set by the runner; use --run-dir"),
        (["--cell-timeout", "0"], "--cell-timeout must be positive"),
        (["--set", "sample.backend=tgi"], "sample.backend must be hf or vllm, got 'tgi'"),
        (["--set", "sample.gpu_memory=0"], "sample.gpu_memory is a share of the GPU, in (0, 1], got 0.0"),
        pytest.param(["--set", "sample.backend=vllm"], "sample.backend=vllm, but vLLM is not installed in",
                     marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")),
    ],
)
def test_bad_run_requests(cli, tmp_path, args, message):
    run_dir, reports = tmp_path / "run", tmp_path / "reports"
    before = tree(tmp_path)
    result = cli("run", "--run-dir", run_dir, "--report-dir", reports, *args)
    assert result.returncode == 2, result
    assert message in result.stderr, result
    assert result.stderr.startswith("slm-bench run: error: ")
    assert tree(tmp_path) == before, "a bad request must write nothing"


def test_run_dir_that_is_a_file(cli, tmp_path):
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("I am a file")
    before = tree(tmp_path)
    result = cli("run", "--run-dir", not_a_dir, "--report-dir", tmp_path / "reports")
    assert result.returncode == 2 and f"run dir {not_a_dir} is not a folder" in result.stderr, result
    nested = cli("run", "--run-dir", not_a_dir / "inside", "--report-dir", tmp_path / "reports")
    assert nested.returncode == 2 and f"{not_a_dir} is a file" in nested.stderr, nested
    assert tree(tmp_path) == before and not_a_dir.read_text() == "I am a file"


def test_stage_without_its_inputs(cli, tmp_path):
    before = tree(tmp_path)
    result = cli("run", "--pipeline", BASIC, "--stages", "double", "--run-dir", tmp_path / "run", "--report-dir", tmp_path / "reports")
    assert result.returncode == 2, result
    assert "stage 'double' needs the output of stage 'source', which is not finished" in result.stderr
    assert "--stages source,double" in result.stderr
    assert tree(tmp_path) == before


def test_unknown_option_and_missing_pipeline(cli, tmp_path):
    before = tree(tmp_path)
    result = cli("run", "--bogus", "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr
    result = cli("run", "--pipeline", tmp_path / "nowhere", "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and f"stages folder {tmp_path / 'nowhere'} does not exist" in result.stderr, result
    assert tree(tmp_path) == before


def test_bad_input_never_touches_the_default_locations(cli):
    before = (tree(ROOT / "runs"), tree(ROOT / "reports"))
    result = cli("run", "--stages", "nope")
    assert result.returncode == 2
    assert (tree(ROOT / "runs"), tree(ROOT / "reports")) == before


def test_lab_bad_requests_write_nothing(cli, tmp_path):
    run_dir = tmp_path / "run"
    made = cli("run", "--pipeline", BASIC, "--stages", "source", "--run-dir", run_dir, "--no-report")
    assert made.returncode == 0, made
    before = tree(tmp_path)
    missing = cli("lab", run_dir, "double", "--pipeline", BASIC, "--scratch", tmp_path / "scratch", "--no-browser")
    assert missing.returncode == 2, missing
    assert f"run {run_dir} has no finished stage 'double'; finished: source" in missing.stderr
    not_a_run = cli("lab", tmp_path / "nowhere", "--pipeline", BASIC, "--scratch", tmp_path / "scratch", "--no-browser")
    assert not_a_run.returncode == 2 and f"run folder {tmp_path / 'nowhere'} does not exist" in not_a_run.stderr, not_a_run
    assert tree(tmp_path) == before, "a bad lab request must write nothing"

    opened = cli("lab", run_dir, "source", "--pipeline", BASIC, "--scratch", tmp_path / "scratch", "--no-browser")
    assert opened.returncode == 0, opened
    assert opened.stdout.splitlines()[0] == f"prepared: {tmp_path / 'scratch' / 'run' / 'source.ipynb'}"
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("scratch")} == before  # the run is untouched


def test_compare_bad_requests_write_nothing(cli, tmp_path):
    (tmp_path / "folder").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "summary.json").write_text('{"stages": [], "metrics": {}}')
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text('{"stages": [], "metrics": {"loss": 1.0}}')
    before = tree(tmp_path)
    reports = tmp_path / "reports"
    for args, message in [
        ([tmp_path / "folder"], f"{tmp_path / 'folder'} is not a run folder: it has no readable summary.json"),
        ([tmp_path / "nowhere"], f"{tmp_path / 'nowhere'} is not a folder"),
        ([empty, other], "the runs empty, other have no benchmark tables or numeric metrics in common: nothing to compare"),
        ([empty], f"{empty} has no benchmark tables yet"),
    ]:
        result = cli("compare", *args, "--report-dir", reports)
        assert result.returncode == 2, result
        assert message in result.stderr, result
    assert tree(tmp_path) == before, "a bad compare must write nothing"

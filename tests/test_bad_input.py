"""Bad requests get exit code 2, a message that names the problem and the fix, and write nothing."""
import pytest

from conftest import PIPELINES, ROOT, tree

BASIC = PIPELINES / "basic"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stages", "nope"], "unknown stage 'nope'; stages: environment, synth, curate, mixture, pretrain, sft, pts, dpo, verifier, evaluate, grid"),
        (["--stages", ","], "--stages needs at least one name, e.g. --stages environment"),
        (["--recipe", "orca3"], "unknown recipe 'orca3'; recipes: common, phi4, tinygsm (see `slm-bench recipes`)"),
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

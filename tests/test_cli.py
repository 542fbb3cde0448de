"""`slm-bench stages`, `profiles`, `report` and `bench`."""
import json

from conftest import PIPELINES


def test_stages_lists_inputs_outputs_and_typed_parameters(cli):
    result = cli("stages")
    assert result.returncode == 0, result
    assert "environment  (00_environment.ipynb)" in result.stdout
    assert "outputs: environment.json, matmul.json, matmul.png" in result.stdout
    assert "sizes: list[int] = [256, 512, 1024, 2048]  # square matrix sizes" in result.stdout
    assert "run_dir: str = 'runs/lab'" in result.stdout and "[set by the runner]" in result.stdout

    listed = json.loads(cli("stages", "--pipeline", PIPELINES / "basic", "--json").stdout)
    assert [s["name"] for s in listed] == ["source", "double"]
    assert listed[1]["inputs"] == ["source"]
    assert listed[1]["parameters"]["factor"] == {"type": "int", "default": 2, "help": "multiplier"}


def test_profiles(cli):
    result = cli("profiles")
    assert result.returncode == 0
    assert "smoke: " in result.stdout and "environment.sizes = [64, 128]" in result.stdout


def test_report_rerenders_a_run(cli, tmp_path):
    run_dir, reports = tmp_path / "myrun", tmp_path / "reports"
    assert cli("run", "--pipeline", PIPELINES / "basic", "--run-dir", run_dir, "--no-report").returncode == 0
    assert not reports.exists()
    result = cli("report", run_dir, "--report-dir", reports)
    assert result.returncode == 0, result
    index = reports / "myrun" / "index.html"
    assert f"report: {index}" in result.stdout
    page = index.read_text()
    assert "href='source.html'" in page and "href='double.html'" in page
    assert (reports / "myrun" / "double.html").is_file()

    missing = cli("report", tmp_path / "nothing", "--report-dir", reports)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_bench_matmul_reports_ratio_to_numpy(cli):
    result = cli("bench", "matmul", "--json")
    assert result.returncode == 0, result
    data = json.loads(result.stdout)
    assert data["benchmark"] == "matmul" and data["baseline"] == "numpy float32 matmul"
    assert [r["n"] for r in data["rows"]] == [256, 512, 1024, 2048]
    for row in data["rows"]:
        assert row["torch_gflops"] > 0 and row["numpy_gflops"] > 0
        assert abs(row["torch_over_numpy"] - row["torch_gflops"] / row["numpy_gflops"]) < 0.01 * row["torch_over_numpy"] + 1e-3
    assert cli("bench", "nope").returncode == 2

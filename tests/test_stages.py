"""Stage declarations and parameters cells: what is accepted, and the errors for what is not."""
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from slm_bench.core.config import PROFILES, resolve_parameters
from slm_bench.core.errors import BadInput
from slm_bench.pipeline.stages import discover_stages, read_stage

PARAMS = 'run_dir: str = "runs/x"  # set by the runner\nout_dir: str = ""  # set by the runner\n'


def write_stage(folder: Path, filename: str, stage: str, params: str = PARAMS, tag: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    cells = [nbformat.v4.new_markdown_cell("# a stage")]
    if stage:
        cells.append(nbformat.v4.new_code_cell(stage))
    param_cell = nbformat.v4.new_code_cell(params)
    if tag:
        param_cell.metadata["tags"] = ["parameters"]
    cells += [param_cell, nbformat.v4.new_code_cell("print('work')")]
    nb.cells = cells
    path = folder / filename
    nbformat.write(nb, path)
    return path


def test_reads_the_real_environment_stage():
    stages = discover_stages(ROOT / "nbs" / "stages")
    env = stages["environment"]
    assert env.inputs == () and "matmul.png" in env.outputs
    assert env.params["sizes"].annotation == "list[int]" and env.params["sizes"].default == [256, 512, 1024, 2048]
    assert env.params["repeats"].help.startswith("timed repeats per size")


def test_papermill_reads_every_parameter_of_every_real_stage():
    "papermill parses a parameters line with its own pattern (an '=' in the comment defeats it): it must see what we see."
    from papermill.translators import PythonTranslator

    for name, stage in discover_stages(ROOT / "nbs" / "stages").items():
        cell = next(c for c in nbformat.read(stage.notebook, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
        assert [p.name for p in PythonTranslator.inspect(cell)] == list(stage.params), name


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_profile_fits_the_real_pipeline(profile):
    stages = discover_stages(ROOT / "nbs" / "stages")
    values = resolve_parameters({n: s.params for n, s in stages.items()}, PROFILES[profile])
    for key, value in PROFILES[profile].values.items():
        stage, name = key.split(".")
        assert values[stage][name] == value


def test_declaration_forms_and_order(tmp_path):
    write_stage(tmp_path, "b.ipynb", "STAGE = {'name': 'late', 'inputs': ['early']}")
    write_stage(tmp_path, "a.ipynb", "STAGE = dict(name='early', outputs=['x.json'])")
    write_stage(tmp_path, "_scratch.ipynb", "STAGE = dict(name='ignored')")
    stages = discover_stages(tmp_path)
    assert list(stages) == ["early", "late"] and stages["early"].outputs == ("x.json",)


@pytest.mark.parametrize(
    "stage, params, tag, message",
    [
        ("", PARAMS, True, "exactly one cell assigning STAGE"),
        ("STAGE = dict(name=f'x')", PARAMS, True, "STAGE must be a literal"),
        ("STAGE = dict(name='a b')", PARAMS, True, "must be a Python identifier"),
        ("STAGE = dict(name='a', colour='red')", PARAMS, True, "unknown keys: colour"),
        ("STAGE = dict(name='a', inputs='b')", PARAMS, True, "STAGE['inputs'] must be a list"),
        ("STAGE = dict(name='a')", PARAMS, False, "exactly one cell tagged 'parameters'"),
        ("STAGE = dict(name='a')", 'out_dir: str = ""\n', True, "must declare `run_dir: str = ...`"),
        ("STAGE = dict(name='a')", PARAMS + "n = 3\n", True, "parameters cell line 3: parameter n has no type"),
        ("STAGE = dict(name='a')", PARAMS + "n: int = 'three'\n", True, "n must be int"),
    ],
)
def test_bad_stage_notebooks(tmp_path, stage, params, tag, message):
    path = write_stage(tmp_path, "s.ipynb", stage, params, tag)
    with pytest.raises(BadInput, match=None) as error:
        read_stage(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_pipeline_level_errors(tmp_path):
    write_stage(tmp_path, "a.ipynb", "STAGE = dict(name='a', inputs=['b'])")
    write_stage(tmp_path, "b.ipynb", "STAGE = dict(name='b', inputs=['a'])")
    with pytest.raises(BadInput, match="cycle"):
        discover_stages(tmp_path)
    write_stage(tmp_path, "b.ipynb", "STAGE = dict(name='a')")
    with pytest.raises(BadInput, match="declared twice"):
        discover_stages(tmp_path)
    write_stage(tmp_path, "b.ipynb", "STAGE = dict(name='b', inputs=['zzz'])")
    (tmp_path / "a.ipynb").unlink()
    with pytest.raises(BadInput, match="input 'zzz' is not a stage"):
        discover_stages(tmp_path)


@pytest.mark.parametrize("output", ["../escape.txt", "/abs/file"])
def test_outputs_must_stay_inside_the_stage_folder(tmp_path, output):
    path = write_stage(tmp_path, "s.ipynb", f"STAGE = dict(name='a', outputs=[{output!r}])")
    with pytest.raises(BadInput, match="must be a path inside the stage folder"):
        read_stage(path)

"""Progress bars of the long command-line jobs: on stderr, each reaching its total, stdout left to the
job's answer; RETOUCH_PROGRESS=0 turns them off and the Python API draws none it was not asked for."""

import json
import re
import time

import pytest
from PIL import Image, ImageDraw

from retouch import progress

# One state of a tqdm bar as it draws it: "DESC:  50%|█████     | 3/6 [...]".
BAR_STATE = re.compile(r"^(?P<desc>.+?): +\d+%\|[^|]*\| (?P<n>\d+)/(?P<total>\d+) ")
ON = {progress.ENV: "1"}  # whatever the environment running the tests says


def final_states(stderr: str) -> dict[str, tuple[int, int]]:
    """The last (n, total) each bar drew, by its description."""
    states = {}
    for line in re.split(r"[\r\n]", stderr):
        if match := BAR_STATE.match(line.strip()):
            states[match["desc"]] = (int(match["n"]), int(match["total"]))
    return states


@pytest.fixture
def inputs(tmp_path):
    template = Image.new("RGB", (64, 64), (40, 120, 200))
    ImageDraw.Draw(template).ellipse((10, 12, 50, 44), fill=(230, 200, 60))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((16, 16, 47, 47), fill=255)
    template.save(tmp_path / "T.png")
    mask.save(tmp_path / "M.png")
    return tmp_path


def edit_args(inputs, *flags) -> list:
    return ["edit", "--model", "tiny-flux-fill", "--image", inputs / "T.png", "--mask", inputs / "M.png",
            "--prompt", "a red hat", "--steps", "3", "--out", inputs / "O.png", *flags]


@pytest.mark.parametrize("flags, bars", [([], {"edit": (3, 3)}),
                                         (["--mask-aware"], {"register template": (3, 3), "edit": (3, 3)})],
                         ids=["baseline", "mask-aware"])
def test_edit_counts_the_denoising_steps(cli, inputs, flags, bars):
    result = cli(*edit_args(inputs, *flags), env=ON)
    assert result.returncode == 0, result.stderr
    assert final_states(result.stderr) == bars  # and no bar of the libraries' own (loading, weights)
    assert result.stdout.startswith("wrote ") and "%|" not in result.stdout


def test_progress_0_turns_every_bar_off(cli, inputs):
    result = cli(*edit_args(inputs), env={progress.ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_profile_bars_reach_the_points_and_load_sizes(cli, tmp_path):
    out = tmp_path / "cost.json"
    result = cli("profile", "--model", "tiny-flux-fill", "--device", "cpu", "--out", out, "--grids", "4,6,8",
                 "--batch-sizes", "1,2", "--mask-ratios", "0.25,0.5,1.0", "--repeats", "1", "--load-mib", "0.5,2,8",
                 env=ON)
    assert result.returncode == 0, result.stderr
    assert final_states(result.stderr) == {"profile blocks": (6, 6), "profile loads": (3, 3)}
    assert json.loads(result.stdout)["out"] == str(out)  # stdout is the one JSON object, nothing else


def test_bench_bar_on_stderr_and_one_json_object_on_stdout(cli):
    result = cli("bench", "step", "--model", "tiny-flux-fill", "--mask-ratio", "0.25,1.0", "--repeats", "1", env=ON)
    assert result.returncode == 0, result.stderr
    assert final_states(result.stderr) == {"step: full vs y/kv-cache": (2, 2)}
    assert len(json.loads(result.stdout)["results"]) == 4


def test_the_python_api_draws_a_bar_only_inside_pipeline_bar(inputs, capfd, monkeypatch):
    from retouch.baseline import run_baseline_edit
    from retouch.models import load_pipeline

    monkeypatch.setenv(progress.ENV, "1")
    model = load_pipeline("tiny-flux-fill")
    image, mask = Image.open(inputs / "T.png"), Image.open(inputs / "M.png")

    def edit():
        run_baseline_edit(model.pipe, image, mask, "a red hat", steps=2, call_defaults=model.call_defaults)
        return final_states(capfd.readouterr().err)

    capfd.readouterr()
    assert edit() == {}
    with progress.pipeline_bar(model.pipe, "edit"):
        assert edit() == {"edit": (2, 2)}
    assert edit() == {}  # off again afterwards, as the loader left it


def test_a_bar_in_a_log_redraws_at_most_every_log_interval(capsys, monkeypatch):
    """Away from a terminal every redraw is a line of the log: a bar shorter than the interval draws
    only its start and its end (at tqdm's terminal pace this one would redraw about five times)."""
    monkeypatch.setenv(progress.ENV, "1")
    for _ in progress.bar(range(100), "items"):
        time.sleep(0.005)
    states = [match for line in re.split(r"[\r\n]", capsys.readouterr().err) if (match := BAR_STATE.match(line))]
    assert [(match["n"], match["total"]) for match in states] == [("0", "100"), ("100", "100")]

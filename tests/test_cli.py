import subprocess
import sys
from pathlib import Path

import pytest

from torch_bridge import cli


def _run(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "functional_state", *args], capture_output=True, text=True, timeout=600, **kw
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "functional-state: error: argument {demo,ab,bench}: invalid choice: 'nope'"),
        (
            ["demo", "--steps", "0"],
            "functional-state demo: error: argument --steps: expected a positive integer, got 0",
        ),
        (
            ["demo", "--feat-map-mib", "-1"],
            "functional-state demo: error: argument --feat-map-mib: expected a number >= 0",
        ),
        (["--bogus"], "functional-state: error: unrecognized arguments: --bogus"),
        (
            ["ab", "--ab-steps", "x"],
            "functional-state ab: error: argument --ab-steps: expected a positive integer, got 'x'",
        ),
        (["bench", "nope"], "functional-state bench: error: argument NAME: invalid choice: 'nope'"),
    ],
)
def test_bad_options_give_one_line_naming_the_subcommand_and_exit_2(args, message):
    out = _run(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


@pytest.mark.parametrize("sub", [[], ["demo"], ["ab"], ["bench"]])
def test_help_describes_every_option_with_its_default(sub):
    out = _run(*sub, "--help")
    assert out.returncode == 0 and "usage: functional-state" in out.stdout
    if sub == ["demo"]:
        for option in ("--sessions", "--steps", "--requests", "--feat-map-mib", "--out-dir", "--no-plot"):
            assert option in out.stdout
        assert "(default: 60)" in out.stdout and "(default: out)" in out.stdout
    if sub == ["ab"]:
        assert "OMNI_DIFFUSION_SESSION_STATE_MANAGER flipped" in out.stdout
    if sub == ["bench"]:
        assert "Benchmarks: accounting, " in out.stdout and "manager" in out.stdout


def test_no_arguments_prints_help_instead_of_running_the_demo():
    out = _run()
    assert out.returncode == 0 and out.stdout.startswith("usage: functional-state") and "{demo,ab,bench}" in out.stdout


def test_version():
    import functional_state

    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"functional-state {functional_state.__version__}"


def test_ab_exits_nonzero_when_a_digest_differs(monkeypatch, capsys):
    def fake(flag, extra):
        return {
            "digest": "same" if flag == "0" or "--deploy-shapes" not in extra else "other",
            "path": "bespoke" if flag == "0" else "manager",
        }

    monkeypatch.setattr(cli, "_rollout_process", fake)
    assert cli.main(["ab"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    monkeypatch.setattr(
        cli, "_rollout_process", lambda flag, extra: {"digest": "d", "path": "bespoke" if flag == "0" else "manager"}
    )
    assert cli.main(["ab"]) == 0


def test_demo_runs_end_to_end_and_writes_the_plot(tmp_path):
    out = _run(
        "demo",
        "--sessions",
        "2",
        "--steps",
        "6",
        "--requests",
        "2",
        "--ab-steps",
        "8",
        "--ab-deploy-steps",
        "4",
        "--plot-steps",
        "12",
        "--budget-steps",
        "6",
        "--feat-map-mib",
        "1",
        "--out-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "every digest matched" in text and "LRU: sessions 2/64" in text and "stats(): {" in text
    assert "in all (each allocation once)" in text and "━" in text  # rich tables and progress bars
    for component in ("stitched_frames", "video_latents", "vae_encoder_out", "vae_enc_feat_map"):
        assert component in text
    assert "parking kept every session, bit-identical" in text and "differ (sessions lost)" in text
    png = tmp_path / "dreamzero_bytes_per_step.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in text


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("functional-state")
    assert script.exists()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "{demo,ab,bench}" in out.stdout

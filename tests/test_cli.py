import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_bridge import cli

ROOT = Path(__file__).resolve().parents[1]


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
        # An option the subcommand does not know is blamed on the subcommand, not on `functional-state`.
        (["demo", "--bogus"], "functional-state demo: error: unrecognized arguments: --bogus"),
        (["ab", "--steps", "3"], "functional-state ab: error: unrecognized arguments: --steps 3"),
        (["bench", "--bogus"], "functional-state bench: error: unrecognized arguments: --bogus"),
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


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_version_and_help_import_neither_torch_nor_the_cli_extras(args):
    # `--help` and `--version` must work on a core-only install (scripts/check_core_without_torch.py runs
    # them there); here: they never import torch, torch_bridge or rich.
    code = textwrap.dedent(
        f"""
        import sys
        from functional_state.__main__ import main
        try:
            main({args!r})
        except SystemExit as e:
            assert e.code == 0, e.code
        loaded = sorted(m for m in ("torch", "torch_bridge", "rich", "matplotlib") if m in sys.modules)
        assert not loaded, loaded
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "functional-state" in out.stdout


def test_bench_rewrites_benchmarks_md_only_with_write(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["bench", "ring"]) == 0
    assert cli.main(["bench", "--write", "ring"]) == 0
    assert "--write" not in calls[0] and calls[0][-1] == "ring"
    assert "--write" in calls[1] and calls[1][-1] == "ring"


def test_benchmarks_run_writes_its_report_only_with_write(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("_bench_run", ROOT / "benchmarks" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    result = {"title": "Ring", "header": ["a", "b"], "rows": [[1, 2]], "ratio": ("speedup", 2.0), "notes": "n"}
    monkeypatch.setattr(run, "_run_isolated", lambda name: result)
    monkeypatch.setattr(run, "_machine", lambda: "test machine")
    report = tmp_path / "BENCHMARKS.md"
    assert run.main(["ring", "--output", str(report)]) == 0
    assert not report.exists() and "## Ring" in capsys.readouterr().out  # printed, not written
    assert run.main(["ring", "--output", str(report), "--write"]) == 0
    assert "## Ring" in report.read_text() and "**speedup: 2**" in report.read_text()


def test_ab_exits_nonzero_when_a_digest_differs(monkeypatch, capsys):
    pytest.importorskip("rich", reason="the command line's tables need the [cli] extra")

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
    for extra in ("rich", "matplotlib"):
        pytest.importorskip(extra, reason="the demo's tables and plot need the [cli] extra")
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
    assert "every digest matched" in text and "LRU: sessions 2/64" in text and "stats(): " in text
    assert "in all: each allocation once" in text and "━" in text
    assert "real Wan encoder (diffusers)" in text and "stats(): {" not in text  # rich tables and progress bars
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

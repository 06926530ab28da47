import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from functional_state.__main__ import main as fs_main
from torch_bridge import cli, runner

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "functional_state", *args], capture_output=True, text=True, timeout=600, **kw
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "functional-state: error: argument {demo,ab,bench,inspect,serve-demo}: invalid choice: 'nope'"),
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
        (
            ["demo", "--camera-hw", "48x81"],
            "functional-state demo: error: argument --camera-hw: expected HxW with H >= 8 and W a multiple of 4",
        ),
        (["ab", "--camera-hw", "big"], "functional-state ab: error: argument --camera-hw: expected HxW"),
        (["demo", "--vae-encoder", "vq"], "functional-state demo: error: argument --vae-encoder: invalid choice"),
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
        for option in ("--sessions", "--steps", "--requests", "--camera-hw", "--vae-encoder", "--out-dir", "--no-plot"):
            assert option in out.stdout
        assert "(default: 60)" in out.stdout and "(default: out)" in out.stdout and "(default: wan)" in out.stdout
    if sub == ["ab"]:
        assert "OMNI_DIFFUSION_SESSION_STATE_MANAGER flipped" in out.stdout
    if sub == ["bench"]:
        assert "Benchmarks: accounting, " in out.stdout and "manager" in out.stdout


def test_no_arguments_prints_help_instead_of_running_the_demo():
    out = _run()
    assert (
        out.returncode == 0
        and out.stdout.startswith("usage: functional-state")
        and "{demo,ab,bench,inspect,serve-demo}" in out.stdout
    )


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
    assert fs_main(["bench", "ring"]) == 0
    assert fs_main(["bench", "--write", "ring"]) == 0
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

    def fake(flag, fields, on_step):
        for _ in range(fields["steps"]):
            on_step()
        return {
            "digest": "same" if flag == "0" or fields["camera_hw"] == [24, 40] else "other",
            "path": "bespoke" if flag == "0" else "manager",
        }

    monkeypatch.setattr(runner, "_rollout_process", fake)
    assert fs_main(["ab"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    monkeypatch.setattr(
        runner,
        "_rollout_process",
        lambda flag, fields, on_step: {"digest": "d", "path": "bespoke" if flag == "0" else "manager"},
    )
    assert fs_main(["ab"]) == 0


def test_ab_child_reports_every_step_and_runs_the_path_the_flag_picks():
    # The A/B bars move per step: the child process reports each one as it finishes it.
    steps = []
    fields = {"camera_hw": [24, 40], "vae_encoder": "stand-in", "feat_map_bytes": 4096, "feat_map_entries": 4}
    for flag, path in (("0", "bespoke"), ("1", "manager")):
        seen = []
        out = runner._rollout_process(flag, {**fields, "steps": 3, "sessions": 2}, lambda seen=seen: seen.append(1))
        assert out["path"] == path and len(out["digest"]) == 64
        steps.append(len(seen))
    assert steps == [3, 3]


_BYTES = r"([\d.]+ (?:B|KiB|MiB|GiB))"


def _nbytes(text):
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_demo_runs_end_to_end_and_writes_the_plot(tmp_path):
    for extra in ("rich", "matplotlib", "diffusers"):
        pytest.importorskip(extra, reason="the demo's tables and plot need the [cli] extra, its encoder [diffusers]")
    out = _run(
        *("demo", "--sessions", "2", "--steps", "6", "--requests", "2", "--ab-steps", "8", "--ab-demo-steps", "4"),
        *("--plot-steps", "12", "--budget-steps", "6", "--camera-hw", "24x40", "--out-dir", str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "every digest matched" in text and "LRU: sessions 2/64" in text and "Pools: manager.stats()" in text
    assert "stats(): {" not in text and "━" in text  # rich tables and progress bars, no raw dict
    assert "stream through the real Wan VAE encoder (diffusers); 3 cameras 24x40 stitched to 48x80" in text
    assert "torch threads: 1" in text
    # One memory table; the two sessions hold the same bytes, so they share its column.
    assert text.count("MiB per DreamZero session") == 1 and "dreamzero-0, dreamzero-1 (each)" in text
    for component in ("stitched_frames", "video_latents", "vae_encoder_out", "vae_enc_feat_map"):
        assert component in text
    assert "parking kept every session, bit-identical" in text and "differ (sessions lost)" in text
    if importlib.util.find_spec("transformers") is not None:  # section 6: real transformers K/V
        assert "stored == formula == stats(), 0 copies, 0 bytes after" in text
        assert "8/8 Llama sessions (idle ones parked) bit-identical to each alone" in text
    png = tmp_path / "dreamzero_bytes_per_step.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in text

    # The recap: every figure is this run's, and they agree with each other and with the tables above.
    recap = text[text.index("Recap: every figure measured in this run") :]
    ab = re.search(r"A/B, bespoke vs manager-backed: bit-identical: (\d+)/(\d+) runs", recap)
    assert ab and ab.group(1) == ab.group(2) == "2"
    ring = re.search(
        rf"bounded ring vs bespoke growth \(12 steps\): encoder output held: bespoke {_BYTES}, ring {_BYTES}: "
        rf"{_BYTES} saved",
        recap,
    )
    assert ring, recap
    bespoke, kept, saved = (_nbytes(g) for g in ring.groups())
    assert bespoke > kept > 0 and abs(bespoke - kept - saved) <= 0.06 * bespoke
    per_frame = re.search(rf"bespoke {_BYTES} \(growing, {_BYTES} per latent frame\)", text)
    assert per_frame and abs(_nbytes(per_frame.group(2)) * 3 - bespoke) <= 0.06 * bespoke  # 12 steps: 3 latents
    budget = re.search(
        rf"byte budget \(6 sessions, budget for 2\): held: peak {_BYTES} <= limit {_BYTES} \(unbudgeted {_BYTES}\); "
        r"(\d+) parks, (\d+) restores, 0 sessions lost, outputs identical; drop-only lost (\d+)",
        recap,
    )
    assert budget, recap
    peak, limit, unbudgeted = (_nbytes(g) for g in budget.groups()[:3])
    parks, restores, dropped = (int(g) for g in budget.groups()[3:])
    assert peak <= limit < unbudgeted and parks > 0 and restores > 0 and dropped > 0
    park = re.search(rf"park bandwidth: park ([\d.]+) GiB/s, restore ([\d.]+) GiB/s of a {_BYTES} feat cache", recap)
    assert park and float(park.group(1)) > 0 and float(park.group(2)) > 0
    feat_map_mib = re.search(r"vae_enc_feat_map +│.*│ +([\d.]+) │", text)
    assert feat_map_mib and abs(_nbytes(park.group(3)) - float(feat_map_mib.group(1)) * 2**20) <= 0.06 * 2**20
    assert "real model code: the VAE encoder: diffusers' AutoencoderKLWan encoder" in recap
    assert re.search(r"\nOK: demo finished in \d+s", text)


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("functional-state")
    assert script.exists()
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "{demo,ab,bench,inspect,serve-demo}" in out.stdout


@pytest.mark.parametrize("argv", [["bench"], ["bench", "ring"]])
def test_bench_from_an_install_says_the_benchmarks_ship_with_the_repository(monkeypatch, capsys, argv):
    # From an installed package `bench` said "invalid choice ... (choose from none: ...)", or with no name
    # ran on until a path was missing.
    import functional_state.__main__ as entry

    monkeypatch.setattr(entry, "_BENCH_DIR", ROOT / "no-such-benchmarks")
    with pytest.raises(SystemExit) as e:
        entry.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ship with the repository" in err and "choose from" not in err

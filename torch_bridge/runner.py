"""What the commands share: the console (log lines and warnings print above the progress bars, which move
step by step), the check for an extra, the harness's rollout configs, and the A/B runner (the same rollout in two
fresh processes, only the manager flag flipped). Torch runs one thread per process (on a shared box, torch's
default threads oversubscribe the cores and every step runs many times slower).

`torch_bridge.cli` dispatches the parsed commands and `torch_bridge.demo` runs the tour; both import this
module, which imports neither.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


class MissingExtraError(RuntimeError):
    """A command needs a package of an extra that is not installed."""


def require_extra(module: str, extra: str, command: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"functional-state {command}: needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'functional-state[{extra}]'"
        ) from None


# --- output: a rich console, with logging and warnings routed above the progress bars --------------------


@contextlib.contextmanager
def open_console(command: str) -> Iterator[Any]:
    rich_console = require_extra("rich.console", "cli", command)
    rich_logging = require_extra("rich.logging", "cli", command)
    console = rich_console.Console(highlight=False)
    if not console.is_terminal:
        console = rich_console.Console(highlight=False, width=120)
    handler = rich_logging.RichHandler(console=console, show_time=False, show_path=False)
    root = logging.getLogger()
    old_handlers, old_level = root.handlers[:], root.level
    root.handlers, root.level = [handler], logging.WARNING
    logging.captureWarnings(True)  # BridgeWarnings and friends print as log lines, above any live bar
    try:
        yield console
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = old_handlers, old_level


def progress_bar(console: Any) -> Any:
    progress = importlib.import_module("rich.progress")
    return progress.Progress(
        progress.SpinnerColumn(),
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TimeElapsedColumn(),
        console=console,
    )


# --- the rollout harness and the networks it runs -----------------------------------------------------------


def load_harness() -> Any:
    """The deterministic DreamZero rollout (configs, networks, one step, a whole run): every use goes
    through here, so the demo and the A/B children import it from one place."""
    from torch_bridge import harness

    return harness


def pin_threads() -> None:
    """One torch thread in this process and in the processes it starts: on a box whose cores other work
    shares, torch's default of a thread per core oversubscribes it and every step runs many times slower."""
    import torch

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # refused once inter-op work has started; then already fixed
        torch.set_num_interop_threads(1)


def rollout_fields(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    """`RolloutConfig` fields for the demo's DreamZero runs (JSON-able: the A/B children get them as text)."""
    return {
        "camera_hw": list(args.camera_hw),
        "vae_encoder": args.vae_encoder,
        "feat_map_bytes": int(args.feat_map_mib * MIB),
        **fields,
    }


def rollout_config(fields: dict[str, Any]) -> Any:
    cfg = dict(fields)
    cfg["camera_hw"] = tuple(cfg["camera_hw"])
    return load_harness().RolloutConfig(**cfg)


def _ab_child(config_json: str) -> int:
    """Body of an A/B child process: one rollout of the given config on the path the environment picks;
    prints a ``{"step": n}`` line per step (the parent's progress), then the result as one JSON line."""
    import torch

    torch.set_num_threads(1)
    cfg = rollout_config(json.loads(config_json))
    result = load_harness().run_rollout(cfg, progress=lambda step: print(json.dumps({"step": step + 1}), flush=True))
    print(json.dumps({"path": result.path, "digest": result.digest}), flush=True)
    return 0


# --- A/B ------------------------------------------------------------------------------------------------


def _rollout_process(flag: str, fields: dict[str, Any], on_step: Any) -> dict[str, Any]:
    """One rollout in a fresh process with only the manager flag set; ``on_step()`` after each of its steps."""
    env = dict(os.environ, OMNI_DIFFUSION_SESSION_STATE_MANAGER=flag, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    code = "import sys; from torch_bridge.runner import _ab_child; sys.exit(_ab_child(sys.argv[1]))"
    result = None
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a chatty child cannot block on it
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(fields)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
            env=env,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours (a library's print)
            if "step" in message:
                on_step()
            else:
                result = message
        if proc.wait() != 0 or result is None:
            err.seek(0)
            raise RuntimeError(f"rollout (flag={flag}) failed:\n{err.read()[-4000:]}")
    return result


def run_ab(console: Any, runs: Sequence[tuple[str, dict[str, Any]]]) -> list[bool]:
    """Each run in two fresh processes side by side (one torch thread each), flag 0 and flag 1; per run,
    whether the digests matched."""
    rich_table = importlib.import_module("rich.table")
    table = rich_table.Table("run", "bespoke digest", "manager digest", "result", "seconds")
    matches = []
    with progress_bar(console) as progress:
        for label, fields in runs:
            task = progress.add_task(f"A/B {label}", total=2 * fields["steps"])
            t0 = time.perf_counter()
            out: dict[str, dict[str, Any]] = {}
            errors: list[BaseException] = []

            def one(flag: str, task: Any = task, fields: Any = fields, out: Any = out, errors: Any = errors) -> None:
                try:
                    out[flag] = _rollout_process(flag, fields, lambda: progress.advance(task))
                except BaseException as e:  # re-raised after the join
                    errors.append(e)

            threads = [threading.Thread(target=one, args=(flag,)) for flag in ("0", "1")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            a, b = out["0"], out["1"]
            match = a["digest"] == b["digest"] and (a["path"], b["path"]) == ("bespoke", "manager")
            matches.append(match)
            table.add_row(
                label,
                a["digest"][:16],
                b["digest"][:16],
                "MATCH" if match else "DIFFER",
                f"{time.perf_counter() - t0:.1f}",
            )
    console.print(table)
    return matches


def ab_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The A/B runs: a long one at small shapes (prompt changes and window resets), and one at the demo's."""
    encoder = "real Wan encoder (diffusers)" if args.vae_encoder == "wan" else "stand-in encoder"
    ch, cw = args.camera_hw
    small = rollout_fields(
        args, steps=args.ab_steps, sessions=3, camera_hw=[24, 40], feat_map_bytes=64 * 1024, feat_map_entries=8
    )
    return [
        (f"{encoder}, 24x40 cameras, {args.ab_steps} steps x 3 sessions", small),
        (
            f"{encoder}, {ch}x{cw} cameras, {args.ab_demo_steps} steps x 2 sessions",
            rollout_fields(args, steps=args.ab_demo_steps, sessions=2),
        ),
    ]

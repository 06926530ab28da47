import logging

import pytest

from functional_state import InvalidArgumentError, resolve_session_state_config
from functional_state.shell.config import ENV_ENABLE, ENV_MAX_SESSIONS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_ENABLE, raising=False)
    monkeypatch.delenv(ENV_MAX_SESSIONS, raising=False)


@pytest.mark.parametrize(
    "env, arg, expected",
    [
        (None, None, False),
        (None, True, True),
        (None, False, False),
        ("1", False, True),
        ("0", True, False),  # force-disable wins over the config
        ("true", None, True),
        ("FALSE", True, False),
        (" Yes ", False, True),
        ("no", True, False),
        ("On", None, True),
        ("off", True, False),
        ("maybe", True, True),  # unparsable: ignored, config wins
        ("maybe", False, False),
        ("", True, True),
    ],
)
def test_enable_precedence(monkeypatch, env, arg, expected):
    if env is not None:
        monkeypatch.setenv(ENV_ENABLE, env)
    assert resolve_session_state_config(enable=arg)[0] is expected


@pytest.mark.parametrize(
    "env, arg, expected, warns",
    [
        (None, None, 64, False),
        (None, 8, 8, False),
        ("16", None, 16, False),
        (" 3 ", 100, 3, False),  # env overrides in both directions
        ("200", 8, 200, False),
        ("0", 8, 8, True),
        ("-5", None, 64, True),
        ("lots", 9, 9, True),
        ("2.5", None, 64, True),
    ],
)
def test_max_sessions_precedence(monkeypatch, caplog, env, arg, expected, warns):
    if env is not None:
        monkeypatch.setenv(ENV_MAX_SESSIONS, env)
    with caplog.at_level(logging.WARNING, logger="functional_state.shell.config"):
        assert resolve_session_state_config(max_sessions=arg)[1] == expected
    assert any(ENV_MAX_SESSIONS in r.message for r in caplog.records) is warns


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_max_sessions_argument(bad):
    with pytest.raises(ValueError, match="max_sessions"):
        resolve_session_state_config(max_sessions=bad)


@pytest.mark.parametrize("preset", [None, "0", "garbage"])
def test_enable_override_sets_and_restores(monkeypatch, preset):
    from functional_state.shell.config import enable_override

    if preset is not None:
        monkeypatch.setenv(ENV_ENABLE, preset)
    with enable_override(True):
        assert resolve_session_state_config(enable=False)[0] is True
        with enable_override(False):
            assert resolve_session_state_config(enable=True)[0] is False
        assert resolve_session_state_config(enable=False)[0] is True
    import os

    assert os.environ.get(ENV_ENABLE) == preset


@pytest.mark.parametrize("pool", ["cpu:0", "gpu:0", "cuda:0/pinned_host"])
def test_config_refuses_budgets_on_pools_stats_never_names(pool):
    # Regression (issue 19): such a budget was accepted and never enforced.
    with pytest.raises(InvalidArgumentError, match=f"unknown pool '{pool}'"):
        resolve_session_state_config(byte_budget={pool: "1GiB"})

"""``redroll worker --claim-prefetch N --recovery-split {halving,alone}``: the flags reach the
worker's settings, over the environment's values, and bad values are refused by name."""

from __future__ import annotations

import pytest

from redroll.cli.main import build_parser
from redroll.cli.worker import worker_settings
from redroll.shared.settings import RECOVERY_SPLITS, Settings


def parse(*flags: str):
    return build_parser().parse_args(["worker", "--engine", "synthetic", *flags])


def test_the_flags_set_the_worker_settings(monkeypatch):
    monkeypatch.delenv("REDROLL_CLAIM_PREFETCH", raising=False)
    monkeypatch.delenv("REDROLL_RECOVERY_SPLIT", raising=False)
    settings = worker_settings(parse("--claim-prefetch", "7", "--recovery-split", "alone"))
    assert (settings.claim_prefetch, settings.recovery_split) == (7, "alone")
    assert worker_settings(parse("--claim-prefetch", "0")).claim_prefetch == 0  # (claim only what starts now)
    defaults = worker_settings(parse())
    assert (defaults.claim_prefetch, defaults.recovery_split) == (Settings().claim_prefetch, Settings().recovery_split)


def test_without_the_flags_the_environment_decides_and_a_flag_beats_it(monkeypatch):
    monkeypatch.setenv("REDROLL_CLAIM_PREFETCH", "5")
    monkeypatch.setenv("REDROLL_RECOVERY_SPLIT", "alone")
    settings = worker_settings(parse())
    assert (settings.claim_prefetch, settings.recovery_split) == (5, "alone")
    settings = worker_settings(parse("--claim-prefetch", "1", "--recovery-split", "halving"))
    assert (settings.claim_prefetch, settings.recovery_split) == (1, "halving")


@pytest.mark.parametrize(("flags", "named"), [
    (("--claim-prefetch", "-1"), "--claim-prefetch: -1 is less than 0"),
    (("--claim-prefetch", "two"), "--claim-prefetch: 'two' is not a whole number"),
    (("--recovery-split", "thirds"), "--recovery-split: invalid choice: 'thirds'"),
])
def test_a_bad_value_is_refused_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as stop:
        parse(*flags)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_the_help_shows_both_flags_with_their_defaults_and_values(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--claim-prefetch N" in help_text and "REDROLL_CLAIM_PREFETCH; default 2" in help_text
    assert "--recovery-split {" + ",".join(RECOVERY_SPLITS) + "}" in help_text
    assert "REDROLL_RECOVERY_SPLIT; default halving" in help_text

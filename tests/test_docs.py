"""The generated reference pages (aenv/docs.py): every setting documented by its own field, the
committed pages what the code says, and the check that `make lint` runs failing on a stale
page."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv import docs
from aenv.config import Config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(Config.model_fields))
def test_every_setting_has_a_description(name: str) -> None:
    assert Config.model_fields[name].description


def test_the_committed_pages_are_what_the_code_says() -> None:
    assert docs.stale(REPO) == []


def test_the_check_fails_on_a_missing_or_stale_page_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert list((tmp_path / "docs").iterdir()) == []
    assert docs.main(["--root", str(tmp_path)]) == 0
    assert docs.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / "docs" / "configuration.md"
    page.write_text(page.read_text().replace("`3000`", "`3001`"))
    assert docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert "`3001`" in page.read_text()


def test_a_row_says_type_bounds_default_and_environment() -> None:
    page = docs.configuration()
    assert "| `jail_uid_base` | `AENV_JAIL_UID_BASE` | integer > 0 or unset | unset |" in page
    assert "| `volume_size_mb` | `AENV_VOLUME_SIZE_MB` | integer ≥ 16, ≤ 1048576 | `1024` |" in page
    assert "| `network_internal` | `AENV_NETWORK_INTERNAL` | list of IPv4 CIDR | empty |" in page
    assert "| `pause_on_shutdown` | `AENV_PAUSE_ON_SHUTDOWN` | switch | `true` |" in page


def test_the_cli_page_has_every_command() -> None:
    page = docs.cli()
    for command in ("aenv server", "aenv template build", "aenv keys create", "aenv node drain"):
        assert f"## `{command}`" in page or f"### `{command}`" in page

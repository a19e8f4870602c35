"""The one bearer-token check and the one token-file reader (:mod:`trainguard.auth`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.auth import TokenError, bearer, bearer_ok, read_token_file

TOKEN = "s3cret-token-of-the-job"


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (bearer(TOKEN)["Authorization"], True),
        (f"bearer  {TOKEN} ", True),
        (None, False),
        ("", False),
        (TOKEN, False),
        (f"Basic {TOKEN}", False),
        (f"Bearer {TOKEN}x", False),
        ("Bearer ", False),
    ],
)
def test_bearer_ok(header: str | None, ok: bool) -> None:
    assert bearer_ok(header, TOKEN) is ok
    assert bearer_ok(header, TOKEN.encode()) is ok


def test_read_token_file_names_the_flag_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    with pytest.raises(TokenError, match=f"--token-file: {path} does not exist"):
        read_token_file(path)
    path.write_text("  \n")
    with pytest.raises(TokenError, match="is empty"):
        read_token_file(path)
    path.write_text(f"{TOKEN}\n")
    path.chmod(0o644)
    assert read_token_file(path) == TOKEN
    with pytest.raises(TokenError, match="chmod 600"):
        read_token_file(path, private=True)
    path.chmod(0o600)
    assert read_token_file(path, "--key", private=True) == TOKEN

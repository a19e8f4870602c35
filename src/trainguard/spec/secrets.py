"""Secrets of a job spec: where ``valueFrom.secretKeyRef`` values come from locally, and
what is hidden wherever a spec is stored or shown.

Rules (the README's "Where secrets go" says the same):

- ``env[].valueFrom.secretKeyRef: {name, key}`` is resolved when the job runs, never
  stored: ``key`` is looked up in the ``--env-file`` files (``KEY=VALUE`` lines; a later
  file wins), then in the environment of ``trainguard run``. ``name`` (the Kubernetes
  Secret) is not used locally: keep keys unique across the secrets a job uses.
- A spec shown or stored (the state database, ``describe``) has ``***`` for the value of
  every env variable whose name looks secret (:func:`looks_secret`), for every
  ``storageOptions`` entry whose key looks secret (at any depth), and for the password of
  a ``user:password@`` URL. ``valueFrom`` entries hold no value, only the reference.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REDACTED",
    "EnvFileError",
    "SecretSource",
    "looks_secret",
    "read_env_file",
    "redact_spec",
    "secret_storage_keys",
]

REDACTED = "***"
# Parts of a name that make its value a secret: WANDB_API_KEY, HF_TOKEN, DB_PASSWORD,
# secret_access_key, aws_session_token, client_secret, private_key_id, ...
_SECRET_WORDS = re.compile(
    r"token|secret|passw|passphrase|credential|key|auth|cookie|private|signature", re.I
)
# `export NAME=value`, `NAME=value`; a Kubernetes Secret's key charset.
_ENV_LINE = re.compile(r"^(?:export\s+)?([-._A-Za-z0-9]+)=(.*)$")
_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/@]*@")


def looks_secret(name: str) -> bool:
    """Whether a variable or option called ``name`` holds a secret (by its name)."""
    return _SECRET_WORDS.search(name) is not None


class EnvFileError(ValueError):
    """An ``--env-file`` that cannot be read; ``str()`` names the file (never a value)."""


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``path``; blank lines and ``#`` comments are skipped, an
    ``export`` prefix is allowed, and one pair of matching quotes around a value is
    removed (no escapes, no ``$VAR`` expansion)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EnvFileError(f"--env-file {path}: file not found") from None
    except UnicodeDecodeError:
        raise EnvFileError(f"--env-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise EnvFileError(f"--env-file {path}: cannot read: {exc.strerror or exc}") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _ENV_LINE.match(stripped)
        if match is None:  # the line itself may be a secret: name only its number
            raise EnvFileError(f"--env-file {path}: line {number}: expected KEY=VALUE")
        key, value = match.groups()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


@dataclass(frozen=True)
class SecretSource:
    """Where a local run finds ``secretKeyRef`` keys: env files, then an environment."""

    files: tuple[tuple[str, Mapping[str, str]], ...] = ()  # (path, its values), in order
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, paths: Sequence[str], environ: Mapping[str, str]) -> SecretSource:
        """Read every ``--env-file``; raises :class:`EnvFileError`."""
        return cls(tuple((str(p), read_env_file(p)) for p in paths), environ)

    def lookup(self, key: str) -> str | None:
        """``key``'s value: the last env file that has it, else the environment."""
        for _, values in reversed(self.files):
            if key in values:
                return values[key]
        return self.environ.get(key)

    def places(self) -> str:
        """Where :meth:`lookup` looked, for an error message."""
        files = [f"--env-file {path}" for path, _ in self.files]
        return ", ".join([*files, "the environment of trainguard run"])


def redact_spec(data: Any) -> Any:
    """A copy of a dumped spec (or any part of it) with its secrets replaced by ``***``."""
    if isinstance(data, list):
        return [redact_spec(item) for item in data]
    if not isinstance(data, dict):
        return _redact_url(data) if isinstance(data, str) else data
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "env" and isinstance(value, list):
            out[key] = [_redact_env_var(var) for var in value]
        elif key in ("storageOptions", "storage_options") and isinstance(value, dict):
            out[key] = _redact_options(value)
        else:
            out[key] = redact_spec(value)
    return out


def secret_storage_keys(options: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the ``storageOptions`` entries that look like credentials."""
    found: list[str] = []
    for key, value in options.items():
        path = f"{prefix}{key}"
        if looks_secret(str(key)):
            found.append(path)
        elif isinstance(value, Mapping):
            found += secret_storage_keys(value, f"{path}.")
    return found


def _redact_env_var(var: Any) -> Any:
    if not isinstance(var, dict):
        return redact_spec(var)
    out = dict(var)
    if out.get("value") is not None and looks_secret(str(out.get("name", ""))):
        out["value"] = REDACTED
    return out


def _redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: REDACTED
        if looks_secret(str(key))
        else _redact_options(value)
        if isinstance(value, Mapping)
        else redact_spec(value)
        for key, value in options.items()
    }


def _redact_url(text: str) -> str:
    """``s3://user:password@host/x`` -> ``s3://user:***@host/x``; other text as it is."""
    return _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text, count=1)

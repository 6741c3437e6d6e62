"""Secret handling in one place: which variables are secret, and masking their values.

Secrets (HF token, API key) come from the environment only; params files may name the
variable (``api_key_env``) but never hold a value.  Everything servebook writes (results,
executed notebooks, the report, the manifest, log tails) passes through :func:`mask`.
"""

from __future__ import annotations

import os
import re

SECRET_NAME = re.compile(r"(token|secret|password|api[_-]?key)", re.IGNORECASE)
MASK = "***"
MIN_SECRET_LEN = 6  # shorter values would mask ordinary words
# variables declared secret whatever their names (api_key_env may name MY_KEY); inherited by every child process,
# so a stage's kernel masks what the runner does
DECLARED = "SERVEBOOK_MASKED_VARS"  # not a secret-looking name: its value, variable names, stays readable


def _declared() -> set[str]:
    return set(filter(None, os.environ.get(DECLARED, "").split(",")))


def declare(name: str) -> None:
    """Treat the variable ``name`` as a secret in this process and every process it starts."""
    if name and name not in _declared():
        os.environ[DECLARED] = ",".join(sorted(_declared() | {name}))


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name)) or name in _declared()


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret or were declared so, longest first."""
    values = {v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def mask(text: str, secrets: list[str] | None = None) -> str:
    for value in secrets if secrets is not None else secret_values():
        text = text.replace(value, MASK)
    return text


def mask_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}

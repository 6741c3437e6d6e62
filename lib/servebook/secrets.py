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


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret, longest first."""
    values = {v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def mask(text: str, secrets: list[str] | None = None) -> str:
    for value in secrets if secrets is not None else secret_values():
        text = text.replace(value, MASK)
    return text


def mask_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}

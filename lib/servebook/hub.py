"""Whether the Hugging Face Hub can be reached, asked once, quickly, before anything asks it in earnest.

huggingface_hub retries a refused or timed-out connection five times with back-off (about 24 s, printing a
"Retrying in 8s" line each time) before it fails. On an air-gapped GPU server that is the normal case, so
servebook asks the endpoint once with a short timeout and, if nothing answers, says so in one line.
"""

from __future__ import annotations

import functools
import os

import httpx

from servebook.errors import HubUnreachable

PROBE_TIMEOUT_S = 5.0


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=4)
def _unreachable(url: str) -> str:
    """Why ``url`` did not answer, or '' when it did (any HTTP status counts as an answer)."""
    try:
        httpx.head(url, timeout=PROBE_TIMEOUT_S, follow_redirects=False)
        return ""
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def require(what: str) -> None:
    """Raise :class:`HubUnreachable` at once when the hub cannot be asked for ``what``."""
    if offline():
        raise HubUnreachable(
            f"{what} needs the Hugging Face Hub, and HF_HUB_OFFLINE is set; point model at a local checkpoint "
            "folder, or unset HF_HUB_OFFLINE"
        )
    url = endpoint()
    why = _unreachable(url)
    if why:
        raise HubUnreachable(
            f"{what}: the Hugging Face Hub at {url} does not answer from this machine ({why}); point model at a "
            "local checkpoint folder, or set HF_ENDPOINT to a mirror this machine can reach"
        )

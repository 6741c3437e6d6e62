"""The type of a JSON object that servebook reads or writes but whose schema is another program's.

Kubernetes manifests, vLLM's benchmark results and API bodies, Hugging Face's config.json,
Plotly figures: their fields are checked where servebook reads them, not by the type checker.
Data servebook owns has its own types (pydantic models, dataclasses); this alias is for the rest.
"""

from __future__ import annotations

from typing import Any, TypeAlias

JsonObject: TypeAlias = dict[str, Any]

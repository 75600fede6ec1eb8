"""The server's options of `krait serve`, apart from the server: building the CLI's parser imports
only this (argparse; no fastapi, pydantic or torch)."""

from __future__ import annotations

import argparse


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's own options of `krait serve` (engine options are added by krait.cli)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1/* routes")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API answers to (default: the model path)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let tool_choice "auto" parse tool calls (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "granite"],
                        help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>) "
                        "or granite (<|tool_call|>[...])")
    return parser

"""The `atom` command: `atom serve MODEL [flags]` and `atom generate [flags]`.

Each subcommand is the module it names, unchanged: `atom serve` is
`python -m atom.entrypoints.openai_server` (the model may come first, as in `vllm serve`)
and `atom generate` is `python -m atom.examples.simple_inference`.
"""

from __future__ import annotations

import sys

USAGE = """usage: atom {serve,generate} ...

  atom serve [MODEL] [flags]   the OpenAI- and Anthropic-compatible server
  atom generate [flags]        offline generation for a few prompts

`atom serve --help` and `atom generate --help` list the flags.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from atom.entrypoints import openai_server

        return openai_server.main(rest, prog="atom serve")
    if command == "generate":
        from atom.examples import simple_inference

        return simple_inference.main(rest, prog="atom generate")
    print(f"atom: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

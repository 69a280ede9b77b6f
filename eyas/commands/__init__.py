"""One module per `eyas` subcommand: `add_arguments(parser)` and `run(args) -> int`."""

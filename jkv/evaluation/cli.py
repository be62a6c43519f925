"""CLI commands of the evaluation harness (placeholder until the harness lands: registers nothing)."""


def add_commands(sub, *, add_model_args, add_method_args, method_from_args):
  del sub, add_model_args, add_method_args, method_from_args

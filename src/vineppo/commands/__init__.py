"""The `vineppo` commands, one module each: its flags (`add_arguments`) and its entry point (`run`).

The command line (vineppo.cli) imports only the module of the command that runs; nothing else imports them. What
a command does lives in the library below (vineppo.training.trainer, vineppo.training.evaluation, vineppo.training.sft, vineppo.analysis.values,
vineppo.analysis.localisation, ...), where the Python API (vineppo.api) calls it too.
"""

"""The ``redroll`` commands, one module per command group.

Each module has ``add_parser(sub)``, which adds its sub-command(s) to the ``redroll`` parser and
sets each one's ``run`` default: a function of the parsed arguments that returns the exit status,
or a coroutine that does (``redroll.cli.main`` runs it). ``redroll.cli.COMMAND_GROUPS`` lists the
modules, in the order ``redroll --help`` shows their commands.
"""

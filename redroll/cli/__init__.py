"""The ``redroll`` command line: one module per command group, and the logic only commands use.

Each command module has ``add_parser(sub)``, which adds its sub-command(s) to the ``redroll``
parser and sets each one's ``run`` default: a function of the parsed arguments that returns the
exit status, or a coroutine that does (:func:`redroll.cli.main.main` runs it).
:data:`redroll.cli.main.COMMAND_GROUPS` lists the modules in the order ``redroll --help`` shows them.
The console script is ``redroll.cli.main:main``.
"""

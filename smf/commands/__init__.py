"""The subcommands of the ``smf`` command line (:mod:`smf.cli`), one module each: ``train`` (``smf retrofit``,
``smf background``, ``smf train``), ``suite``, ``report`` and ``eval``. Each defines ``COMMANDS = {name: one-line
help}``, ``add_arguments(parser, name)`` and ``run(args) -> exit code``.

They sit above the packages they drive (``smf eval --config`` reads a suite config, ``smf report`` a suite
directory), and import what needs torch or transformers, and the suite config's schema, inside functions so that
building the parser stays light.
"""

"""The top layer: the command line (one module per subcommand in :mod:`.commands`), the web app, export of saved
results and the report pages. Nothing below imports it."""

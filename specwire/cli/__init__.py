"""The command line: `specwire` (main.py), its flags (args.py, placement.py), the
typed settings built from them (settings.py) and one module per sub-command (commands/).

argparse namespaces and flag names stop here; the code below takes typed settings."""

"""The `specwire` sub-commands, one module each: flags in, typed settings out.

argparse namespaces stop here: a command turns its flags into the dataclasses
of specwire/settings.py (settings.py, bench.py), so the code below depends on
what it uses, not on the command line.
"""

"""cloudpickle as forkguard sends functions and classes by value (to fork-server children): with
the file each function's code came from.

cloudpickle 3.1 writes every dynamic function's code with the file name "<dynamic-code>" (for
payloads that do not depend on where the code is), so a traceback from a child that unpickled it
shows neither the file nor its source lines, where a forked child (torch's DataLoader workers)
shows both. forkguard's children run on the same machine as their parent: the real name lets
linecache find the source. With older cloudpickle (Debian 12's 2.2) the name was kept already.
"""
import io
import types
from collections import ChainMap

import cloudpickle

_ANONYMOUS = "<dynamic-code>"


def _code_reduce(code):
    build, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    if _ANONYMOUS in args:
        i = args.index(_ANONYMOUS)
        args = args[:i] + (code.co_filename,) + args[i + 1:]
    return build, args


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, keeping code objects' file names."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps(obj, protocol=None):
    file = io.BytesIO()
    Pickler(file, protocol=protocol).dump(obj)
    return file.getvalue()

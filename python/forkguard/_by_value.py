"""cloudpickle as forkguard sends functions and classes by value (to fork-server children): with
the file each function's code came from.

cloudpickle 3.1 writes every dynamic function's code with the file name "<dynamic-code>" (for
payloads that do not depend on where the code is), so a traceback from a child that unpickled it
shows neither the file nor its source lines, where a forked child (torch's DataLoader workers)
shows both. forkguard's children run on the same machine as their parent: the real name lets
linecache find the source. With older cloudpickle (Debian 12's 2.2) the name was kept already.

In a child of multiprocessing's spawn (torch.multiprocessing.spawn's ranks) the script runs as
module ``__mp_main__``, an alias a fork-server child has not: cloudpickle would pickle its
functions and classes by reference to it. They go by value, as ``__main__``'s do.
"""
import io
import sys
import types
from collections import ChainMap

import cloudpickle

# cloudpickle's module with its reducers (cloudpickle.cloudpickle in 3.x, cloudpickle_fast in 2.x)
_impl = sys.modules[cloudpickle.Pickler.__module__]

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

    def reducer_override(self, obj):
        if isinstance(obj, type) and getattr(obj, "__module__", None) == "__mp_main__":
            return _impl._dynamic_class_reduce(obj)
        if isinstance(obj, types.FunctionType) and obj.__module__ == "__mp_main__":
            return self._dynamic_function_reduce(obj)
        return super().reducer_override(obj)


def dumps(obj, protocol=None):
    file = io.BytesIO()
    Pickler(file, protocol=protocol).dump(obj)
    return file.getvalue()

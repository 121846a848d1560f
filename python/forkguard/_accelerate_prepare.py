"""forkguard.DataLoader through accelerate's ``Accelerator.prepare()``: still forkguard's workers.

accelerate does not iterate the loader it is given. ``prepare_data_loader`` (and
``skip_first_batches``, for a resumed epoch) read its attributes and build a new loader: an
adapter (``DataLoaderShard``, ``DataLoaderDispatcher``, ``SkipDataLoader``) around a new *torch*
DataLoader, ``base_dataloader``, which the adapter's ``__iter__`` iterates. So a
forkguard.DataLoader came out as torch's loader underneath, with torch's forked workers: its
protection, options and state silently gone. Here, when such a function is given a
forkguard.DataLoader (or a loader accelerate made from one), what it returns is changed in place,
once, before anyone holds it:

- its ``base_dataloader`` becomes a forkguard.DataLoader: the object torch built, with accelerate's
  sampler, dataset and options, its class set to forkguard's, and the given loader's forkguard
  options (worker_start, cuda_in_workers, seed, bad_sample) and state (the next pass's number, a
  resumption load_state_dict() left pending, the ``stats`` record, which both share) copied onto
  it: see ``_adopt_base``. forkguard's iterator then does the work, whatever the adapter does around
  it (the look-ahead, the device placement, the skipped batches);
- the adapter's class becomes a subclass of accelerate's, made once per class (``_made``), with
  accelerate's name: ``type(dl).__name__``, ``isinstance(dl, DataLoaderShard)`` and every method
  are accelerate's, except three that must know the base is forkguard's (``_Adapter``).

Why not mix forkguard's iterator into accelerate's class instead: since accelerate 1.0 its classes
are not DataLoaders (they answer ``__class__`` with their base's class, a property), and their
``__iter__`` never calls ``_get_iterator``; the loader that iterates is the base. Why not build a
new forkguard.DataLoader from the base's attributes: torch's constructor would have to be given
back exactly what accelerate gave it (a batch sampler, or a BatchSampler as sampler with a
batch size, or a batch size for an iterable), a recipe that differs per accelerate path; changing
the class of the object torch built keeps what torch checked and set.

``install_if_loaded()`` (at every forkguard.DataLoader's construction) wraps those functions where
``accelerate.data_loader`` is imported already, else once it is (a ``sys.meta_path`` finder for
that module alone, gone once it patched): ``import forkguard`` never imports accelerate. A name
bound before the wrap by ``from accelerate.data_loader import prepare_data_loader`` outside
accelerate keeps the unwrapped function.

accelerate 1.11 to 1.16 build these loaders the same way (tests/python/test_accelerate_prepare.py
runs each). What differs, and is met here only:
- ``adjust_state_dict_for_prefetch``: 1.11 and 1.12 apply torchdata's correction (the batches the
  adapter read ahead) to every adapter, indexing torchdata's keys, which forkguard's state has not
  (a KeyError in a distributed run); 1.13 stopped correcting ``DataLoaderShard`` (its snapshot is
  taken before it reads ahead) and looks the keys up. ``_Adapter`` corrects forkguard's count on
  every version as 1.13 and later do: ``DataLoaderDispatcher``'s only.
- ``skip_first_batches`` gives the new loader the epoch it came from (``iteration``) from 1.15 on;
  before, epoch 0. forkguard's base follows accelerate's epoch (``_Adapter.set_epoch``), so with
  ``seed=`` the skipped pass's samples are those of that epoch on 1.15 and later.
- accelerate before 1.0 (not supported) subclassed torch's DataLoader: nothing here applies, and
  ``_adopt`` warns that forkguard's workers are not in use.
"""
import functools
import importlib.abc
import sys
import threading
import warnings

_lock = threading.Lock()
_installed = False
_finder = None
_made_classes = {}  # accelerate's adapter class -> the subclass made of it
# The functions wrapped, and whether the loader they return takes a pending resumption along
# (prepare: yes, it is the given loader's continuation; skip_first_batches: no, the skip is the
# resumption).
_WRAPPED = {"prepare_data_loader": True, "skip_first_batches": False}
_MODULE = "accelerate.data_loader"


def install_if_loaded():
    """Wraps accelerate's loader-making functions now if accelerate.data_loader is imported, else
    when it is. Idempotent and cheap (called by every forkguard.DataLoader)."""
    global _installed, _finder
    if _installed:
        return
    with _lock:
        if _installed:
            return
        module = sys.modules.get(_MODULE)
        if module is not None and hasattr(module, "prepare_data_loader"):
            _patch(module)
        elif _finder is None:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
        _installed = True


def _patch(data_loader):
    """Wraps the functions in accelerate.data_loader and where accelerate's own modules bound
    them (accelerate.accelerator, accelerate) before this ran."""
    originals = {}
    for name, carry_resume in _WRAPPED.items():
        original = getattr(data_loader, name, None)
        if original is None or hasattr(original, "_forkguard_original"):
            continue
        wrapper = _wrap(original, carry_resume)
        setattr(data_loader, name, wrapper)
        originals[id(original)] = wrapper
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "accelerate" or
                                  module_name.startswith("accelerate.")):
            continue
        for name in _WRAPPED:
            bound = getattr(module, name, None)
            if bound is not None and id(bound) in originals:
                setattr(module, name, originals[id(bound)])


def _wrap(original, carry_resume):
    @functools.wraps(original)
    def wrapper(dataloader, *args, **kwargs):
        source = _forkguard_loader_of(dataloader)
        result = original(dataloader, *args, **kwargs)
        if source is not None:
            _adopt(result, source, carry_resume)
        return result

    wrapper._forkguard_original = original
    return wrapper


class _Finder(importlib.abc.MetaPathFinder):
    """Finds accelerate.data_loader as the other finders do, and patches it once executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not a loader we can follow: accelerate's loaders are not adopted
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """accelerate.data_loader's own loader, then _patch; everything else is the loader's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        global _finder
        self._loader.exec_module(module)
        with _lock:
            _patch(module)
            if _finder is not None:
                try:
                    sys.meta_path.remove(_finder)
                except ValueError:
                    pass
                _finder = None

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _forkguard_loader_of(obj):
    """The forkguard.DataLoader behind `obj` (itself, or the base of an accelerate loader made
    from one), or None. By type: an accelerate adapter answers __class__ with its base's."""
    from ._dataloader import DataLoader

    if issubclass(type(obj), DataLoader):
        return obj
    base = getattr(obj, "__dict__", {}).get("base_dataloader")
    if base is None:
        inner = getattr(obj, "__dict__", {}).get("_loader")  # XLA's MpDeviceLoaderWrapper
        return _forkguard_loader_of(inner) if inner is not None else None
    return base if issubclass(type(base), DataLoader) else None


def _adopt(result, source, carry_resume):
    """`result`, made by accelerate from the forkguard.DataLoader `source`, iterates with
    forkguard's workers and options from now on."""
    import torch.utils.data
    from accelerate import data_loader as acc

    loader = result
    wrapper = getattr(acc, "MpDeviceLoaderWrapper", None)
    if wrapper is not None and isinstance(result, wrapper):
        loader = result._loader
    adapter = getattr(acc, "DataLoaderAdapter", None)
    if adapter is not None and issubclass(type(loader), adapter):
        if _adopt_base(loader.base_dataloader, source, carry_resume):
            object.__dict__["__class__"].__set__(loader, _made(type(loader)))
            # as accelerate's adapter does for a base that has state_dict() (torchdata's)
            loader.dl_state_dict = loader.base_dataloader.state_dict()
        return
    if type(loader) is torch.utils.data.DataLoader:  # skip_first_batches of a plain loader
        _adopt_base(loader, source, carry_resume)
        return
    _not_adopted(loader, f"accelerate returned a {type(loader).__module__}."
                         f"{type(loader).__qualname__}, which forkguard does not know")


def _adopt_base(base, source, carry_resume):
    """Makes the torch DataLoader `base` a forkguard.DataLoader with `source`'s options and
    state; False (said) where `base` is another kind of loader."""
    import torch.utils.data
    from ._dataloader import DataLoader

    if issubclass(type(base), DataLoader):
        return True  # adopted already (a loader passed through twice)
    if type(base) is not torch.utils.data.DataLoader:
        _not_adopted(base, f"accelerate's base loader is a {type(base).__module__}."
                           f"{type(base).__qualname__} (use_stateful_dataloader=True makes it "
                           f"torchdata's StatefulDataLoader); forkguard.DataLoader has "
                           f"state_dict()/load_state_dict() itself: prepare it without")
        return False
    # NOTE [the adopted base's state]: what forkguard.DataLoader.__init__ set beside torch's
    # attributes (its options, its pass number, a pending resumption, its stats, and whatever a
    # later forkguard adds there) is copied by reference, but for the iterator of the source's
    # current pass, which is not this loader's, and, for skip_first_batches, the pending
    # resumption, which the skip replaces.
    own = vars(base)
    base.__class__ = DataLoader
    for name, value in vars(source).items():
        if name not in own:
            setattr(base, name, value)
    base._live = None
    if not carry_resume:
        base._resume = None
    return True


def _not_adopted(loader, why):
    # Said, not raised: accelerate's loader works, with torch's workers, as it did before.
    warnings.warn(f"forkguard.DataLoader through accelerate: {why}, so this loader's workers are "
                  f"torch's, not forkguard's (forkguard's options and CUDA protection do not "
                  f"apply to it)", UserWarning, stacklevel=2)


class _Adapter:
    """What accelerate's adapter does differently around forkguard's base."""

    # DataLoaderDispatcher snapshots the base's state once per base batch while it reads the next
    # step's num_processes batches: forkguard's count is corrected as accelerate corrects
    # torchdata's. DataLoaderShard's snapshot is taken before it reads ahead (accelerate >= 1.13).
    _fg_reads_ahead = False

    def set_epoch(self, epoch):
        """accelerate's set_epoch (its samplers, its `iteration`), and forkguard's pass number."""
        theirs = getattr(super(), "set_epoch", None)
        if theirs is not None:
            theirs(epoch)
        self.base_dataloader.set_epoch(epoch)

    def adjust_state_dict_for_prefetch(self):
        if not self._fg_reads_ahead:
            return
        from accelerate.state import DistributedType, PartialState

        state = PartialState()
        if state.distributed_type != DistributedType.NO and self.dl_state_dict["yielded"] > 0:
            self.dl_state_dict["yielded"] = max(
                0, self.dl_state_dict["yielded"] - (state.num_processes - 1))

    def __reduce__(self):
        # accelerate's gives its own class (its adapters' __class__ is the base's): ours, by the
        # name this module answers (__getattr__)
        theirs = super().__reduce__()
        return (type(self),) + tuple(theirs[1:])


def _made(cls):
    """The subclass of accelerate's adapter class `cls` with _Adapter's methods, made once."""
    made = _made_classes.get(cls)
    if made is None:
        from accelerate.data_loader import DataLoaderDispatcher

        made = type(cls.__name__, (_Adapter, cls), {
            "__module__": __name__, "__qualname__": cls.__name__,
            "__doc__": cls.__doc__,
            "_fg_reads_ahead": issubclass(cls, DataLoaderDispatcher)})
        _made_classes[cls] = made
    return made


def __getattr__(name):
    # pickle's path to a made class: forkguard._accelerate_prepare.DataLoaderShard
    if name in ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader"):
        from accelerate import data_loader

        return _made(getattr(data_loader, name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

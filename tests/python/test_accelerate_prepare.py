"""forkguard.DataLoader through accelerate's Accelerator.prepare() (_accelerate_prepare.py), on
every accelerate of the matrix (accelerate_matrix.py: 1.11 to 1.16 on the torch 2.14 venv, each
selected by PYTHONPATH). Each scenario runs in a child interpreter (test_dataloader.py's `script`
fixture: nothing may be left behind):

  (a) prepare() returns accelerate's DataLoaderShard (its name, isinstance, methods) whose
      batches come from forkguard's workers (their process name), with forkguard's options (the
      samples of seed= for each epoch): the unprepared loader's batches, pass after pass; an
      IterableDataset's DataLoaderDispatcher too; state_dict() mid-pass resumes a prepared loader;
      pickle keeps it; accelerate imported before or after the first forkguard.DataLoader;
  (b) skip_first_batches() on it yields the remaining batches, from forkguard's workers;
  (c) a Dataset that tries CUDA (and swallows the error) in a process that asked
      torch.cuda.is_available(): through prepare(), torch's loader hands the loop "Cannot
      re-initialize CUDA in forked subprocess" in every sample, forkguard's in none.

Skipped where accelerate is not installed (Debian's torch 1.13.1: accelerate 1.x needs torch 2).
"""
import sys

import pytest

import accelerate_matrix as matrix

matrix.skip_module_without_accelerate()
from test_dataloader import script  # noqa: E402,F401 - the fixture: a child interpreter each

VERSIONS = matrix.pinned_versions()
FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"


@pytest.fixture(scope="module")
def installed():
    return matrix.installed()


@pytest.fixture()
def on_accelerate(script, installed, monkeypatch):  # noqa: F811 - the fixture imported above
    """script(...) with one accelerate of the matrix first on the child's PYTHONPATH."""
    def select(version):
        if version not in installed:
            pytest.fail(f"accelerate {version} is pinned (python/requirements/) but not "
                        f"installed beside {sys.prefix}: run scripts/install-torch-venv")
        monkeypatch.setenv("PYTHONPATH", matrix.pythonpath(installed[version]))
        return script

    return select


# --- (a), (b): prepare() and skip_first_batches() keep forkguard's workers ---------------------

PREPARE = '''
import pickle, random


class Rows(Dataset):
    """Each sample says whether forkguard's worker made it (the worker's process name) and draws
    from Python's random, which seed= sets per (seed, epoch, index)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        with open("/proc/self/comm") as f:
            ours = f.read().startswith("fg-dl-worker")
        return torch.tensor([i, i * i, ours, random.random()], dtype=torch.float64)


class Stream(IterableDataset):  # accelerate dispatches an IterableDataset's batches
    def __iter__(self):
        info = get_worker_info()
        with open("/proc/self/comm") as f:
            ours = f.read().startswith("fg-dl-worker")
        for i in range(info.id if info else 0, 12, info.num_workers if info else 1):
            yield torch.tensor([i, ours])


def rows(loader):
    return [r for b in loader for r in b.tolist()]


def make(**kw):
    return forkguard.DataLoader(Rows(), batch_size=2, num_workers=2, shuffle=True, seed=7, **kw)


def kind(loader):
    """What user code sees of a loader: its class's name and module, isinstance."""
    from accelerate.data_loader import DataLoaderShard, DataLoaderDispatcher

    return {"name": type(loader).__name__, "shard": isinstance(loader, DataLoaderShard),
            "dispatcher": isinstance(loader, DataLoaderDispatcher),
            "torch": isinstance(loader, TorchDataLoader),
            "forkguard": isinstance(loader, forkguard.DataLoader),
            "base": type(loader.base_dataloader).__module__}


def main(order):
    if order == "forkguard first":
        make()
    early = "accelerate" in sys.modules  # forkguard.DataLoader does not import accelerate
    import accelerate
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    ref = make()
    expected = [rows(ref), rows(ref)]  # epochs 0 and 1

    # pickled before any pass (NOTE: accelerate pickles every loader its GradientState holds)
    pickled = pickle.loads(pickle.dumps(acc.prepare(make())))
    dl = acc.prepare(make())
    got = [rows(dl), rows(dl)]
    options = {"seed": dl.seed, "worker_start": dl.worker_start,
               "passes": [e["epoch"] for e in dl.stats["epochs"]]}

    # (b) the first two batches of epoch 0 skipped, by the Accelerator and by the function
    skipped = acc.skip_first_batches(acc.prepare(make()), num_batches=2)
    skipped_fn = accelerate.skip_first_batches(acc.prepare(make()), num_batches=3)

    # state_dict() after two batches of a pass, loaded into another prepared loader
    half = acc.prepare(make())
    it = iter(half)
    taken = [r for _ in range(2) for r in next(it).tolist()]
    state = half.state_dict()
    it.close()
    resumed = acc.prepare(make())
    resumed.load_state_dict(state)

    stream = acc.prepare(forkguard.DataLoader(Stream(), batch_size=2, num_workers=2))
    theirs = acc.prepare(TorchDataLoader(Rows(), batch_size=2, num_workers=2))
    out = dict(
        version=accelerate.__version__, early=early, expected=expected, got=got,
        kind=kind(dl), options=options, pickled=[kind(pickled), rows(pickled)],
        skipped=[kind(skipped), rows(skipped)], skipped_fn=[kind(skipped_fn), rows(skipped_fn)],
        taken=taken, yielded=state["yielded"], resumed=rows(resumed),
        stream=[kind(stream), rows(stream),
                rows(forkguard.DataLoader(Stream(), batch_size=2, num_workers=2))],
        theirs=[kind(theirs), rows(theirs)])
    wait_for(lambda: not workers())
    result(workers=workers(), children=children(), **out)


main(sys.argv[1])
'''


def ours(rows):
    """Whether every row was made by one of forkguard's workers (the flag in column 2)."""
    return bool(rows) and all(r[2] == 1 for r in rows)


@pytest.mark.parametrize("order", ["accelerate first", "forkguard first"])
@pytest.mark.parametrize("version", VERSIONS)
def test_prepare_returns_accelerates_loader_iterating_with_forkguards_workers(on_accelerate,
                                                                              version, order):
    out, r = on_accelerate(version)(PREPARE, args=[order])
    assert r["version"] == version
    assert r["early"] is False
    e0, e1 = r["expected"]
    assert len(e0) == 10 and ours(e0) and e0 != e1  # seed=: another order and draw per epoch
    # (a) accelerate's class, forkguard's workers, forkguard's samples for each epoch
    shard = {"name": "DataLoaderShard", "shard": True, "dispatcher": False, "torch": True,
             "forkguard": True, "base": "forkguard._dataloader"}
    assert r["kind"] == shard
    assert r["got"] == [e0, e1]
    assert r["options"] == {"seed": 7, "worker_start": "auto", "passes": [0, 1]}
    assert r["pickled"] == [shard, e0]
    # (b) the remaining batches of the pass, from forkguard's workers
    assert r["skipped"] == [shard, e0[4:]]
    assert r["skipped_fn"] == [shard, e0[6:]]
    # resumed after two batches: the rest of the pass
    assert r["taken"] == e0[:4] and r["yielded"] == 2
    assert r["resumed"] == e0[4:]
    # an IterableDataset: accelerate's DataLoaderDispatcher, forkguard's workers
    kind, got, unprepared = r["stream"]
    assert kind == {"name": "DataLoaderDispatcher", "shard": False, "dispatcher": True,
                    "torch": True, "forkguard": True, "base": "forkguard._dataloader"}
    assert got == unprepared and len(got) == 12 and all(row[1] == 1 for row in got)
    # torch's own loader through prepare() is left as it was: torch's workers
    kind, theirs = r["theirs"]
    assert kind["name"] == "DataLoaderShard" and not kind["forkguard"]
    assert kind["base"] == "torch.utils.data.dataloader"
    assert len(theirs) == 10 and not any(row[2] for row in theirs)
    assert r["workers"] == [] and r["children"] == []


# --- (c) CUDA tried in a worker of a prepared loader -------------------------------------------
# Needs forkguard.DataLoader's rerouting of a forked worker's CUDA use (NOTE [ CUDA in a forked
# worker ] in _dataloader.py): prepare() alone only keeps forkguard's workers.

CUDA_IN_WORKER = '''
class Tries(Dataset):
    """What users write to "check the GPU": the error swallowed, its text returned."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        try:
            torch.zeros(1, device="cuda")
            msg = "ok"
        except RuntimeError as e:
            msg = str(e)
        return i, msg


def samples(loader):
    return [list(s) for b in loader for s in b]


def main():
    print("is_available:", torch.cuda.is_available(), flush=True)  # torch's fork poison
    import accelerate
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    theirs = samples(acc.prepare(TorchDataLoader(Tries(), batch_size=2, num_workers=2,
                                                 collate_fn=list)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = acc.prepare(forkguard.DataLoader(Tries(), batch_size=2, num_workers=2,
                                                  collate_fn=list))
        ours = samples(loader)
    wait_for(lambda: not workers())
    result(version=accelerate.__version__, theirs=theirs, ours=ours, name=type(loader).__name__,
           warnings=[str(w.message) for w in caught], workers=workers(), children=children())


main()
'''


@pytest.mark.parametrize("version", VERSIONS)
def test_c_cuda_tried_in_a_prepared_loaders_worker_never_reaches_the_loop(on_accelerate,
                                                                          version):
    out, r = on_accelerate(version)(CUDA_IN_WORKER)
    assert r["version"] == version
    # torch's loader through prepare(): its forked workers, every sample the fork's error
    assert [i for i, _ in r["theirs"]] == list(range(8))
    assert all(FORKED_CUDA in msg for _, msg in r["theirs"]), r["theirs"]
    # forkguard's: every sample, none made where CUDA could not start (without a GPU, the clean
    # worker's own error: no driver)
    assert r["name"] == "DataLoaderShard"
    assert [i for i, _ in r["ours"]] == list(range(8)), r["ours"]
    assert not any(FORKED_CUDA in msg for _, msg in r["ours"]), r["ours"]
    assert r["workers"] == [] and r["children"] == []

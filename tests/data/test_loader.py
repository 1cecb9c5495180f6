"""The loader: windows and document ids, one seeded global order, exact resume (also across a
change in the number of data-parallel ranks), prefetching workers, and its error messages."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data.config import LoaderConfig
from data.errors import DataError
from data.loader import Batch, TokenLoader
from data.manifest import Manifest
from data.prepare import prepare
from data.tokenizer import TokenizerIdentity
from tests.data.helpers import prepare_config

SEQ = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, corpus_dir, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("dataset")
    prepare(prepare_config(corpus_dir, out, tokenizer_dir, val_fraction=0.25))
    return out


def loader(path: Path, global_batch: int = 8, rank: int = 0, size: int = 1, **kw) -> TokenLoader:
    opts = dict(path=str(path), seq_len=SEQ, num_workers=0, val_batches=2)
    opts.update(kw)
    return TokenLoader(LoaderConfig(**opts), global_batch=global_batch, dp_rank=rank, dp_size=size)


def take(it, n: int) -> list[Batch]:
    return list(itertools.islice(it, n))


def train_stream(path: Path) -> np.ndarray:
    m = Manifest.load(path)
    return np.concatenate([np.fromfile(path / r.bin, dtype=m.dtype) for r in m.splits["train"]])


def test_windows_are_stream_slices_with_shifted_targets_and_document_ids(dataset):
    stream, eot = train_stream(dataset), Manifest.load(dataset).eot_id
    lo = loader(dataset, shuffle=False)
    batches = take(iter(lo), lo.windows // 8)
    for b, batch in enumerate(batches):
        for row in range(8):
            i = b * 8 + row
            window = stream[i * SEQ : i * SEQ + SEQ + 1]
            assert batch.inputs[row].tolist() == window[:-1].tolist()
            assert batch.targets[row].tolist() == window[1:].tolist()
            # a new document starts after every EOT: ids count the EOTs before each position
            before = np.concatenate([[0], np.cumsum(window[:-1] == eot)[:-1]])
            assert batch.doc_ids[row].tolist() == before.tolist()
    assert batches[0].inputs.dtype == torch.int64 and batches[0].doc_ids.dtype == torch.int32
    assert any(int(b.doc_ids.max()) > 0 for b in batches)  # boundaries do occur


def test_one_epoch_visits_every_window_once_in_a_seeded_order(dataset):
    lo = loader(dataset, global_batch=1)
    n = lo.windows
    order = lo.order(np.arange(n))
    assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))
    again = loader(dataset, global_batch=1).order(np.arange(2 * n))
    assert again[:n].tolist() == order.tolist()
    assert sorted(again[n:].tolist()) == list(range(n)) and again[n:].tolist() != order.tolist()


def test_two_loaders_give_the_same_batches(dataset):
    a, b = take(iter(loader(dataset)), 5), take(iter(loader(dataset)), 5)
    assert all(
        torch.equal(x.inputs, y.inputs) and torch.equal(x.doc_ids, y.doc_ids) for x, y in zip(a, b)
    )


def test_different_seeds_give_different_orders(dataset):
    cfg = LoaderConfig(path=str(dataset), seq_len=SEQ, num_workers=0)
    a = next(iter(TokenLoader(cfg, global_batch=8, seed=0)))
    b = next(iter(TokenLoader(cfg, global_batch=8, seed=1)))
    assert not torch.equal(a.inputs, b.inputs)


def test_load_state_dict_resumes_the_next_batches_exactly(dataset):
    lo = loader(dataset)
    it = iter(lo)
    take(it, 4)
    state = json.loads(json.dumps(lo.state_dict()))  # what a checkpoint stores
    expected = take(it, 6)
    resumed = loader(dataset)
    resumed.load_state_dict(state)
    got = take(iter(resumed), 6)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(got, expected))
    assert all(torch.equal(x.doc_ids, y.doc_ids) for x, y in zip(got, expected))


def global_batches(path: Path, size: int, steps: int, state: dict | None = None):
    """Each step's global batch, assembled from `size` in-process ranks (rank order)."""
    ranks = [loader(path, global_batch=8, rank=r, size=size) for r in range(size)]
    for lo in ranks:
        if state is not None:
            lo.load_state_dict(state)
    per_rank = [take(iter(lo), steps) for lo in ranks]
    steps_out = [torch.cat([per_rank[r][s].inputs for r in range(size)]) for s in range(steps)]
    return steps_out, ranks[0].state_dict()


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resuming_with_another_number_of_ranks_continues_the_global_stream(dataset, before, after):
    reference, _ = global_batches(dataset, 1, 7)
    first, state = global_batches(dataset, before, 3)
    rest, _ = global_batches(dataset, after, 4, state)
    got = first + rest
    assert all(torch.equal(g, r) for g, r in zip(got, reference))
    ranks = [loader(dataset, rank=r, size=2) for r in range(2)]
    local = [next(iter(lo)).inputs for lo in ranks]
    assert not torch.equal(local[0], local[1])  # each rank reads its own slice


def test_batches_wrap_into_the_next_epoch_without_a_gap(dataset):
    stream = train_stream(dataset)
    lo = loader(dataset, global_batch=8)
    n = lo.windows
    steps = n // 8 + 2
    batches = take(iter(lo), steps)
    assert lo.position == steps * 8 and lo.epoch > 1
    firsts = [int(row[0]) for b in batches for row in b.inputs]
    windows = lo.order(np.arange(steps * 8))
    assert firsts == [int(stream[w * SEQ]) for w in windows]  # batches follow the global order
    assert sorted(windows[:n].tolist()) == list(range(n))  # epoch 0 visits each window once
    second = windows[n:]  # the start of epoch 1: distinct windows, in a new order
    assert len(set(second.tolist())) == len(second) and second.max() < n
    assert second.tolist() != windows[: len(second)].tolist()


def test_prefetching_workers_change_nothing(dataset):
    plain = take(iter(loader(dataset, num_workers=0)), 5)
    lo = loader(dataset, num_workers=2, prefetch=3)
    prefetched = take(iter(lo), 5)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(plain, prefetched))
    assert lo.state_dict()["position"] == 5 * 8  # prefetched batches are not counted


def test_validation_is_the_same_every_time_and_sliced_by_rank(dataset):
    lo = loader(dataset)
    a, b = list(lo.validation()), list(lo.validation())
    assert len(a) == 2 and all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b))
    halves = [list(loader(dataset, rank=r, size=2).validation()) for r in range(2)]
    assert torch.equal(torch.cat([halves[0][0].inputs, halves[1][0].inputs]), a[0].inputs)


def test_the_tokenizer_comes_with_the_dataset(dataset, tokenizer_dir):
    lo = loader(dataset)
    assert lo.tokenizer.identity == Manifest.load(dataset).tokenizer
    text = lo.tokenizer.decode(next(iter(lo)).inputs[0].tolist())
    assert isinstance(text, str) and text


# -- errors -------------------------------------------------------------------------------------


def copy_dataset(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_tokenizer_mismatch_names_both_tokenizers(dataset):
    other = TokenizerIdentity(name="cl100k_base", hash="f" * 64)
    with pytest.raises(DataError, match=r"tokenized with .* but the model uses cl100k_base"):
        TokenLoader(
            LoaderConfig(path=str(dataset), seq_len=SEQ), global_batch=8, expected_tokenizer=other
        )


def test_missing_and_truncated_shards_are_named(dataset, tmp_path):
    d = copy_dataset(dataset, tmp_path / "d")
    (d / "train" / "00002.bin").unlink()
    with pytest.raises(DataError, match=r"00002.bin is missing; re-run .*data.prepare"):
        loader(d)
    d2 = copy_dataset(dataset, tmp_path / "d2")
    with open(d2 / "train" / "00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"00001.bin is truncated or damaged: 100 bytes"):
        loader(d2)


def test_a_checksum_mismatch_is_found_lazily_or_on_open(dataset, tmp_path):
    d = copy_dataset(dataset, tmp_path / "d")
    shard = d / "train" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="00000.bin does not match its checksum"):
        loader(d, verify="full")
    lazy = loader(d, verify="lazy", shuffle=False)  # opens fine: nothing read yet
    with pytest.raises(DataError, match="00000.bin does not match its checksum"):
        next(iter(lazy))
    assert next(iter(loader(d, verify="size"))) is not None


def test_an_unfinished_preparation_and_a_missing_dataset(tmp_path, dataset):
    d = copy_dataset(dataset, tmp_path / "d")
    (d / "manifest.json").unlink()
    with pytest.raises(DataError, match="preparation has not finished: re-run the same"):
        loader(d)
    with pytest.raises(DataError, match=r"no manifest.json in .*python -m data.prepare"):
        loader(tmp_path / "nothing")


def test_state_from_another_order_is_refused(dataset):
    state = loader(dataset).state_dict()
    with pytest.raises(DataError, match="seq_len=16 but this loader has seq_len=8"):
        loader(dataset, seq_len=8).load_state_dict(state)
    with pytest.raises(DataError, match="dataset="):
        loader(dataset).load_state_dict(state | {"dataset": "0" * 16})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(global_batch=6, size=4), "global batch 6 must be a positive multiple of the 4"),
        (dict(seq_len=10**7), "fewer than one window of data.seq_len"),
    ],
)
def test_bad_loader_settings(dataset, kwargs, message):
    with pytest.raises(DataError, match=message):
        loader(dataset, **kwargs)


def test_a_validation_split_smaller_than_a_batch_is_refused_on_open(dataset):
    with pytest.raises(DataError, match="fewer than one global batch.*data.val_batches=0"):
        loader(dataset, global_batch=64, seq_len=512)
    assert list(loader(dataset, global_batch=64, seq_len=512, val_batches=0).validation()) == []


def test_a_worker_error_arrives_as_one_clear_line(dataset, tmp_path):
    d = copy_dataset(dataset, tmp_path / "d")
    for shard in (d / "train").glob("*.bin"):
        data = bytearray(shard.read_bytes())
        data[0] ^= 0xFF
        shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        next(iter(loader(d, num_workers=1)))
    assert "does not match its checksum" in str(err.value)
    assert "Traceback" not in str(err.value) and "\n" not in str(err.value)


def test_open_shards_are_bounded_and_a_pickled_reader_carries_no_maps(dataset, monkeypatch):
    import pickle

    from data import reader as reader_module

    monkeypatch.setattr(reader_module, "MAX_OPEN_SHARDS", 3)
    lo = loader(dataset, global_batch=8)
    take(iter(lo), 10)  # shuffled windows touch every shard
    assert 0 < len(lo.train._maps) <= 3
    clone = pickle.loads(pickle.dumps(lo.train))
    assert len(clone._maps) == 0 and len(pickle.dumps(lo.train)) < 20_000


def test_loader_config_validation():
    with pytest.raises(DataError, match="data.verify=sometimes"):
        LoaderConfig(path="x", verify="sometimes")
    with pytest.raises(DataError, match="data.seq_len=0"):
        LoaderConfig(path="x", seq_len=0)

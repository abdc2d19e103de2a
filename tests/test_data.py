"""Data pipelines: byte-level IMDB from the real archive, ListOps generation, TSVs and tokens."""
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pytest
import torch
from filelock import FileLock

from conftest import imdb_source
from magicube.train import data, imdb, listops

IMDB = imdb_source()
needs_imdb = pytest.mark.skipif(IMDB is None, reason="aclImdb_v1.tar.gz not found (set MAGICUBE_IMDB)")


@pytest.fixture(scope="module")
def reviews():
    return imdb.read_imdb(IMDB)


@needs_imdb
def test_imdb_archive_complete_and_labelled(reviews):
    for split in imdb.SPLITS:
        d = reviews[split]
        assert len(d["label"]) == 25_000 and sum(d["label"]) == 12_500
        # ratings: negative reviews <= 4 stars, positive >= 7 (the dataset's definition)
        assert all((r >= 7) == bool(lab) for r, lab in zip(d["rating"][::97], d["label"][::97]))
        assert all(isinstance(t, bytes) and t for t in d["text"][:100])


@needs_imdb
def test_imdb_folder_matches_archive(tmp_path, reviews):
    """The unpacked layout reads the same reviews as the archive."""
    want = {}
    for split in imdb.SPLITS:
        d = reviews[split]
        for i in (0, 1, 20_000):  # two negatives and a positive per split
            label = "pos" if d["label"][i] else "neg"
            f = tmp_path / "aclImdb" / split / label / f"{d['id'][i]}_{d['rating'][i]}.txt"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(d["text"][i])
            want[(split, d["id"][i], d["label"][i])] = d["text"][i]
    def reviews_at(path):
        got = imdb.read_imdb(imdb.find_imdb(path))
        return {(s, i, lab): t for s in imdb.SPLITS for i, lab, t in zip(got[s]["id"], got[s]["label"], got[s]["text"])}

    assert reviews_at(tmp_path) == want
    # the same reviews recompressed (xz packs the archive a third smaller than gzip)
    xz = tmp_path / "imdb.tar.xz"
    with tarfile.open(xz, "w:xz") as tar:
        tar.add(tmp_path / "aclImdb", arcname="aclImdb")
    assert reviews_at(xz) == want


@needs_imdb
def test_imdb_dataset_encoding_and_cache(tmp_path, reviews, monkeypatch):
    cfg = {"task": "text", "path": str(IMDB), "cache_dir": str(tmp_path), "limit": 16}
    monkeypatch.setattr(imdb, "read_imdb", lambda path: reviews)  # read once per module, above
    ds = data.build_datasets(cfg, 300)
    assert set(ds) == {"train", "test"} and len(ds["train"]) == 16
    assert 0 < sum(ds["test"]["label"]) < 16  # the subset is not one class
    row = ds["train"][3]
    decoded = bytes(b - 1 for b in row["input_ids"] if b)
    i = next(i for i, t in enumerate(reviews["train"]["text"]) if t[:300] == decoded)
    text = reviews["train"]["text"][i]
    assert row["label"] == reviews["train"]["label"][i]
    expect = [b + 1 for b in text[:300]] + [0] * max(0, 300 - len(text))
    assert row["input_ids"] == expect
    assert max(max(r) for r in ds["test"]["input_ids"]) <= 256
    # a second build reads the Arrow cache, not the archive
    monkeypatch.setattr(imdb, "read_imdb", lambda *_: pytest.fail("cache miss"))
    t = data.load_tensors(cfg, 300)
    assert t["train"][0].shape == (16, 300) and t["train"][0][3].tolist() == expect


def test_imdb_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="aclImdb_v1.tar.gz"):
        imdb.find_imdb(tmp_path / "nowhere")


def test_imdb_bad_archive(tmp_path):
    bad = tmp_path / "aclImdb_v1.tar.gz"
    with tarfile.open(bad, "w:gz"):
        pass
    with pytest.raises(ValueError, match="no reviews"):
        imdb.read_imdb(bad)


# ---- ListOps ------------------------------------------------------------------------------

def evaluate_listops(source: str) -> tuple[int, int, list[int]]:
    """Independent stack evaluator: (value, deepest tree level, argument counts)."""
    stack, depth, counts = [[None, []]], 1, []
    level = 1
    for tok in source.split():
        if tok in ("(", ")"):
            continue
        if tok.startswith("["):
            stack.append([tok[1:], []])
            level += 1
        elif tok == "]":
            op, args = stack.pop()
            level -= 1
            counts.append(len(args))
            value = {"MIN": min, "MAX": max, "SM": lambda a: sum(a) % 10,
                     "MED": lambda a: int(sorted(a)[len(a) // 2] if len(a) % 2 else
                                          (sorted(a)[len(a) // 2 - 1] + sorted(a)[len(a) // 2]) / 2)}[op](args)
            stack[-1][1].append(value)
        else:
            stack[-1][1].append(int(tok))
            depth = max(depth, level)
    (_, top), = stack
    assert len(top) == 1
    return top[0], depth, counts


SMALL = listops.ListOpsSpec(num_train=300, num_val=20, num_test=20, max_depth=5, max_args=6, min_length=10,
                            max_length=80, seed=3)


def test_listops_rules_and_labels():
    d = listops.generate(SMALL)
    assert {k: len(v) for k, v in d.items()} == {"train": 300, "val": 20, "test": 20}
    everything = [s for rows in d.values() for s, _ in rows]
    assert len(set(everything)) == len(everything)
    ops_seen = set()
    for src, target in d["train"] + d["val"] + d["test"]:
        n = len(src.split())
        assert SMALL.min_length < n < SMALL.max_length
        value, depth, counts = evaluate_listops(src)
        assert value == target and 0 <= target <= 9
        assert depth <= SMALL.max_depth
        assert all(2 <= c <= SMALL.max_args for c in counts)
        ops_seen |= {t for t in src.split() if t.startswith("[")}
    assert ops_seen == set(listops.OPERATORS)


def test_listops_full_setting_lengths():
    spec = listops.ListOpsSpec(num_train=5, num_val=0, num_test=0)
    assert (listops.ListOpsSpec().counts(), spec.max_depth, spec.max_args, spec.min_length, spec.max_length) == \
        ({"train": 96_000, "val": 2_000, "test": 2_000}, 10, 10, 500, 2000)
    for src, target in listops.generate(spec)["train"]:
        assert 500 < len(src.split()) < 2000
        value, depth, _ = evaluate_listops(src)
        assert value == target and depth <= 10


def test_listops_deterministic_by_seed():
    assert listops.generate(SMALL) == listops.generate(SMALL)
    other = listops.generate(listops.ListOpsSpec(**{**SMALL.__dict__, "seed": 4}))
    assert other["train"] != listops.generate(SMALL)["train"]


def test_listops_tsv_roundtrip_and_tokens(tmp_path):
    paths = listops.write_splits(tmp_path / "new" / "lo", SMALL)  # the folder is made
    assert paths["train"].name == "basic_train.tsv"
    assert paths["val"].read_text().splitlines()[0] == "Source\tTarget"
    src, tgt = listops.read_tsv(paths["train"])
    assert list(zip(src, tgt)) == listops.generate(SMALL)["train"]
    ids = listops.encode("[MAX 2 9 [MIN 4 7 ] 0 ]", 12)
    v = listops.TOKEN_TO_ID
    assert ids == [v["[MAX"], v["2"], v["9"], v["[MIN"], v["4"], v["7"], v["]"], v["0"], v["]"], 0, 0, 0]
    assert listops.encode("( ( [SM 1 ) 2 ) ]", 3) == [v["[SM"], v["1"], v["2"]]  # LRA's parenthesised form
    assert len(listops.VOCAB) == 16 and listops.VOCAB[0] == "<pad>"


def test_listops_dataset_pipeline(tmp_path):
    cfg = {"task": "listops", "path": str(tmp_path / "lo"), "auto_generate": True, "cache_dir": str(tmp_path / "c"),
           "generate": SMALL.__dict__}
    t = data.load_tensors(cfg, 64)
    assert t["train"][0].shape == (300, 64) and t["val"][0].shape == (20, 64)
    src, tgt = listops.read_tsv(tmp_path / "lo" / "basic_test.tsv")
    assert t["test"][0][5].tolist() == listops.encode(src[5], 64)
    assert t["test"][1].tolist() == tgt


def test_an_interrupted_cache_build_leaves_nothing_behind(tmp_path, monkeypatch):
    cfg = {"task": "listops", "path": str(tmp_path / "lo"), "auto_generate": True, "cache_dir": str(tmp_path / "c"),
           "generate": SMALL.__dict__}
    save = datasets.Dataset.save_to_disk

    def ctrl_c_after_one_split(self, path, *args, **kwargs):
        if Path(path).name != "train":
            raise KeyboardInterrupt
        return save(self, path, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", ctrl_c_after_one_split)
    with pytest.raises(KeyboardInterrupt):
        data.load_tensors(cfg, 64)
    assert not any(p.is_dir() for p in (tmp_path / "c").iterdir())  # nor the train split it had written


def test_listops_settings_out_of_range_and_empty_splits_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"data.generate.max_depth: expected an integer >= 1, got 0"):
        listops.ListOpsSpec(max_depth=0)
    with pytest.raises(ValueError, match=r"data.generate.max_length: expected an integer >= min_length = 10, got 5"):
        listops.ListOpsSpec(min_length=10, max_length=5)
    cfg = {"task": "listops", "path": str(tmp_path / "lo"), "auto_generate": True, "cache_dir": str(tmp_path / "c"),
           "generate": {**SMALL.__dict__, "num_test": 0}}  # generated (an empty file), but nothing to train on
    with pytest.raises(ValueError, match=r"data: the test split of .* holds no examples"):
        data.load_tensors(cfg, 64)
    assert not any(p.is_dir() for p in (tmp_path / "c").iterdir())  # no cache, not even a part of one


@pytest.mark.parametrize("content, match", [
    ("Text\tLabel\n[MAX 1 2 ]\t2\n", "header"),
    ("Source\tTarget\n[MAX 1 2 ]\t12\n", "not a digit"),
    ("Source\tTarget\n[MAX 1 2 ]\n", "2 tab-separated"),
    ("Source\tTarget\n[FOO 1 2 ]\t2\n", "unknown tokens"),
])
def test_listops_malformed_files_name_the_file(tmp_path, content, match):
    p = tmp_path / "basic_train.tsv"
    p.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        listops.read_tsv(p)
    assert str(p) in str(e.value) and "magicube data listops" in str(e.value)


def test_listops_folder_that_cannot_be_written_fails_before_generating(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(listops, "generate", lambda spec: pytest.fail("generated first"))
    with pytest.raises(OSError, match=r"file/lo: cannot write files there \(.*/file is a file\)"):
        listops.write_splits(tmp_path / "file" / "lo", SMALL)


def test_listops_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="magicube data listops"):
        data.build_datasets({"task": "listops", "path": str(tmp_path), "cache_dir": str(tmp_path / "c")}, 32)


def test_cache_is_built_once_and_cleans_up_after_a_killed_build(tmp_path, monkeypatch):
    cfg = {"task": "listops", "path": str(tmp_path / "lo"), "auto_generate": True, "cache_dir": str(tmp_path / "c"),
           "generate": SMALL.__dict__}
    want = data.load_tensors(cfg, 64)
    (cache,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    # A build killed outright (SIGKILL) left its folder; the next build removes it.
    (cache / "done").unlink()
    left = cache.with_name(cache.name + ".tmp")
    (left / "train").mkdir(parents=True)
    got = data.load_tensors(cfg, 64)
    assert torch.equal(got["test"][0], want["test"][0]) and (cache / "done").is_file() and not left.exists()
    # A run that waited for another's build of the same cache takes it rather than building again.
    (cache / "done").rename(tmp_path / "done")
    monkeypatch.setattr(data, "_build", lambda *args: pytest.fail("built twice"))
    with ThreadPoolExecutor(1) as pool:
        with FileLock(cache.with_name(cache.name + ".lock")):
            waiting = pool.submit(data.load_tensors, cfg, 64)
            time.sleep(0.5)
            assert not waiting.done()  # held at the lock
            (tmp_path / "done").rename(cache / "done")
        assert torch.equal(waiting.result()["test"][0], want["test"][0])



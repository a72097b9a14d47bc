"""The tiered template activation store: budgets, LRU spills down the tiers, disk round trips,
corrupt or missing files as misses, prefetch."""

import torch

from gouache.templates.store import TemplateStore


def entry(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {"out": torch.full((n,), float(value)), "idx": torch.arange(n)}


BYTES = 4 * 4 + 4 * 8  # one entry: 4 float32 + 4 int64


def file_bytes(tmp_path) -> int:
    """What one entry takes on disk (tensors plus the safetensors header)."""
    probe = TemplateStore(tmp_path / "probe", {"disk": 1 << 20})
    probe.put("probe", entry(0))
    return probe.nbytes("disk")


def test_entries_spill_down_the_tiers_least_recently_used_first(tmp_path):
    on_disk = file_bytes(tmp_path)
    store = TemplateStore(tmp_path / "store", {"device": BYTES, "host": BYTES, "disk": 2 * on_disk})
    for i in range(4):
        store.put(f"t{i}", entry(i))
    assert [store.tier_of(f"t{i}") for i in range(4)] == ["disk", "disk", "host", "device"]
    store.put("t4", entry(4))  # the disk holds two: the oldest file goes
    assert store.tier_of("t0") is None and [store.tier_of(f"t{i}") for i in (1, 2)] == ["disk", "disk"]
    files = list((tmp_path / "store").glob("*.safetensors"))
    assert len(files) == 2 and all(p.suffix == ".safetensors" for p in files)
    assert (store.nbytes("device"), store.nbytes("host")) == (BYTES, BYTES) and store.nbytes("disk") <= 2 * on_disk


def test_a_hit_moves_to_the_top_and_equals_what_was_put(tmp_path):
    store = TemplateStore(tmp_path, {"host": BYTES, "disk": 1 << 20})
    store.put("a", entry(1.5))
    store.put("b", entry(2.5))
    assert store.tier_of("a") == "disk"
    got = store.get("a")
    assert torch.equal(got["out"], entry(1.5)["out"]) and torch.equal(got["idx"], entry(1.5)["idx"])
    assert store.tier_of("a") == "host" and store.tier_of("b") == "disk"
    assert store.hits["disk"] == 1 and store.get("nothing") is None and store.misses == 1


def test_a_corrupt_or_missing_file_is_a_miss_never_a_wrong_entry(tmp_path):
    store = TemplateStore(tmp_path, {"disk": 1 << 20})
    for key in ("flipped", "truncated", "gone", "good"):
        store.put(key, entry(3.0))
    files = {key: store._disk[key].path for key in ("flipped", "truncated", "gone")}
    data = bytearray(files["flipped"].read_bytes())
    data[-1] ^= 0x40  # a flipped bit in the tensor data: still a valid safetensors file
    files["flipped"].write_bytes(bytes(data))
    files["truncated"].write_bytes(files["truncated"].read_bytes()[:20])
    files["gone"].unlink()
    assert [store.get(key) for key in ("flipped", "truncated", "gone")] == [None, None, None]
    assert store.corrupt == 3 and all(store.tier_of(k) is None for k in files)
    assert torch.equal(store.get("good")["out"], entry(3.0)["out"])


def test_prefetch_reads_ahead_and_get_takes_its_result(tmp_path):
    store = TemplateStore(tmp_path, {"disk": 1 << 20})
    store.put("a", entry(7.0))
    store.prefetch("a")
    store.prefetch("not-there")  # no-op
    assert torch.equal(store.get("a")["out"], entry(7.0)["out"]) and store.hits["disk"] == 1
    store.close()


def test_unknown_tiers_are_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown tier"):
        TemplateStore(tmp_path, {"gpu": 1})


def test_a_disk_only_store_reads_its_files_without_writing_them_again(tmp_path):
    store = TemplateStore(tmp_path, {"disk": 1 << 20})
    store.put("a", entry(1.0))
    path = store._disk["a"].path
    written = path.stat().st_mtime_ns
    for _ in range(3):
        store.prefetch("a")
        assert torch.equal(store.get("a")["out"], entry(1.0)["out"])
    assert path.stat().st_mtime_ns == written and store.hits["disk"] == 3 and store.tier_of("a") == "disk"
    assert store.nbytes("disk") == path.stat().st_size


def test_reads_started_for_a_reader_that_left_are_dropped(tmp_path):
    store = TemplateStore(tmp_path, {"disk": 1 << 20})
    for key in ("t:1/0", "t:1/1", "u:1/0"):
        store.put(key, entry(1.0))
        store.prefetch(key)
    store.drop_reads("t:1/")
    assert set(store._reads) == {"u:1/0"}
    assert torch.equal(store.get("t:1/1")["out"], entry(1.0)["out"])  # still on disk: read when asked


def test_a_restart_adopts_its_files_within_the_budget_and_deletes_what_it_cannot_use(tmp_path):
    import pytest

    first = TemplateStore(tmp_path, {"disk": 1 << 20}, owner="model-a")
    for i in range(4):
        first.put(f"t{i}", entry(i))
    size = first.nbytes("disk")
    with pytest.raises(ValueError, match="in use by another template store"):
        TemplateStore(tmp_path, {"disk": 1 << 20}, owner="model-a")
    first.close()
    (tmp_path / f"{'0' * 32}.tmp").write_bytes(b"half a file")  # a write the last run did not finish
    (tmp_path / "notes.txt").write_text("not a store's")  # someone else's file
    again = TemplateStore(tmp_path, {"disk": size // 2}, owner="model-a")  # a smaller budget this time
    assert again.adopted == 2 and again.nbytes("disk") <= size // 2
    assert [again.tier_of(f"t{i}") for i in range(4)] == [None, None, "disk", "disk"]  # the newest kept
    assert torch.equal(again.get("t3")["out"], entry(3)["out"])
    assert sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) == again.nbytes("disk")
    assert not list(tmp_path.glob("*.tmp")) and (tmp_path / "notes.txt").exists()
    again.close()
    other = TemplateStore(tmp_path, {"disk": 1 << 20}, owner="model-b")  # another model: none of it is its
    assert other.adopted == 0 and not list(tmp_path.glob("*.safetensors"))

"""Files users own, read while they rewrite them: a LoRA or ControlNet rewritten in place never
kills the process (each read gives the old version, the new one, or the adapter's own error);
what is loaded is identified by its bytes, so a replaced file is read anew whatever its
timestamps, and an unchanged one is not; a LoRA is checked against a table of the denoiser,
never the live model that template replay may have wrapped."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from gouache.adapter_names import ControlNetError, LoraError
from gouache.controlnet.cache import SAFETENSORS, ControlNetCache
from gouache.controlnet.model import Base, random_controlnet
from gouache.files import FileChanging, digest, header_of, read_file, read_header
from gouache.lora.files import random_lora
from gouache.lora.store import LoraStore
from gouache.models.zoo import load_pipeline
from gouache.templates.unet import MaskedTransformerBlock, unet_template_blocks


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-sd")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "controlnet"])
def test_an_adapter_rewritten_in_place_while_it_is_read_never_kills_the_process(tmp_path, kind):
    # before files were read whole, safetensors mapped them: a truncated mapping is SIGBUS (6 of 6 runs)
    result = subprocess.run([sys.executable, "-m", "tests.files.rewrite", kind, str(tmp_path), "2"],
                            capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert result.returncode == 0, result.stderr[-2000:]
    counts = json.loads(result.stdout.splitlines()[-1])
    assert counts["ok"] > 0 and counts["refused"] > 0  # both cases happened
    assert set(counts["seen"]) <= set(counts["versions"])  # never a mix of the two


def test_a_file_that_keeps_changing_while_it_is_read_is_refused(tmp_path, monkeypatch):
    from gouache import files

    path = tmp_path / "x.safetensors"
    path.write_bytes(b"a" * 100)
    monkeypatch.setattr(files, "_RETRY_S", 0.0)
    read = open

    def growing(file, mode="r", *args):  # every read finds the file longer than its status said
        handle = read(file, mode, *args)
        with read(file, "ab") as more:
            more.write(b"b")
        return handle

    monkeypatch.setattr("builtins.open", growing)
    with pytest.raises(FileChanging, match="changed while it was read"):
        read_file(path)
    monkeypatch.setattr("builtins.open", read)
    assert read_file(path).data == b"a" * 100 + b"b" * files.READ_ATTEMPTS


def test_the_header_reader_agrees_with_safetensors_and_refuses_a_truncated_file(tmp_path):
    tensors = {"w": torch.randn(3, 4), "alpha": torch.tensor(2.0, dtype=torch.float16), "one": torch.ones(1, 1)}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    header = read_header(tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", "pt") as handle:
        assert header.metadata == handle.metadata()
        assert {k: info["shape"] for k, info in header.tensors.items()} == {
            k: handle.get_slice(k).get_shape() for k in handle.keys()}
    assert set(header.scalars) == {"alpha", "one"}
    data = (tmp_path / "x.safetensors").read_bytes()
    assert header_of(data).tensors == header.tensors
    for cut in (4, 20, len(data) - 8):
        with pytest.raises(ValueError, match="not a safetensors file"):
            header_of(data[:cut])


def test_a_lora_file_replaced_is_read_anew_and_one_rewritten_unchanged_is_not(pipe, tmp_path):
    first, second = save(random_lora(pipe, seed=1)), save(random_lora(pipe, seed=2))
    path = tmp_path / "x.safetensors"
    path.write_bytes(first)
    store = LoraStore(tmp_path, pipe)
    old = store.load("x").result()
    stamp = os.stat(path)
    (tmp_path / "new").write_bytes(second)
    os.replace(tmp_path / "new", path)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the same timestamp: only the content says
    new = store.load("x").result()
    assert (old.digest, new.digest) == (digest(first), digest(second))
    assert not torch.equal(next(iter(old.layers.values())).down, next(iter(new.layers.values())).down)
    assert store.digest("x") == digest(second)
    path.write_bytes(second)  # rewritten with the same bytes: read again, the same adapter
    assert store.load("x").result() is new
    assert store.load("x").result() is new and store.counts.hits == 1
    path.write_bytes(second[: len(second) // 2])  # caught half-written: the request's 400
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        store.check("x")
    with pytest.raises(LoraError, match="not a readable safetensors file"):
        store.load("x").result()


def test_a_lora_is_checked_while_template_replay_has_wrapped_the_unet_blocks(pipe, tmp_path):
    save_file(random_lora(pipe, seed=3), tmp_path / "x.safetensors")
    store = LoraStore(tmp_path, pipe)
    slots = unet_template_blocks(pipe.unet)
    originals = [getattr(parent, name) for parent, name, _ in slots]
    try:  # as `templates.unet.masked_blocks` does for a replaying forward on the engine thread
        for (parent, name, key), block in zip(slots, originals):
            setattr(parent, name, MaskedTransformerBlock(block, key, None))
        store.check("x")  # failed with "this model has no module ...transformer_blocks.0.attn1.to_k"
        assert store.load("x").result().layers
    finally:
        for (parent, name, _), block in zip(slots, originals):
            setattr(parent, name, block)


def test_a_controlnet_whose_weights_are_replaced_is_loaded_anew(pipe, tmp_path):
    for seed in (1, 2):
        random_controlnet(pipe, seed=seed, std=0.2).save_pretrained(str(tmp_path / f"v{seed}"))
    os.replace(tmp_path / "v1", tmp_path / "x")
    cache = ControlNetCache(tmp_path, Base.of(pipe))
    old = cache.get("x")
    weights = tmp_path / "x" / SAFETENSORS
    stamp = os.stat(weights)
    expected = load_file(tmp_path / "v2" / SAFETENSORS)
    os.replace(tmp_path / "v2" / SAFETENSORS, weights)  # config.json unchanged
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert cache.load("x")["loaded"]  # POST /v1/controlnets loads the new weights
    new = cache.get("x")
    assert new is not old and cache.get("x") is new
    assert all(torch.equal(value, expected[key]) for key, value in new.state_dict().items())
    weights.write_bytes(weights.read_bytes()[:1000])  # caught half-written: the request's 400
    with pytest.raises(ControlNetError, match="could not be loaded"):
        cache.get("x")


def test_an_adapter_file_spoilt_after_admission_fails_its_request_as_its_own_input(pipe, tmp_path):
    import numpy as np

    from gouache.config import ControlNetConfig, LoraConfig
    from gouache.request import ImageRequest
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch

    save_file(random_lora(pipe, seed=1), tmp_path / "x.safetensors")
    random_controlnet(pipe, seed=1).save_pretrained(str(tmp_path / "c"))
    runner = ModelRunner(pipe, lora=LoraConfig(str(tmp_path)), controlnet=ControlNetConfig(str(tmp_path)))
    runner.lora_runtime.store.check("x")  # admitted: the file was whole then
    runner.controls.check("c")
    for path in (tmp_path / "x.safetensors", tmp_path / "c" / SAFETENSORS):
        path.write_bytes(path.read_bytes()[:100])  # then caught half-written by the loads
    control = np.zeros((64, 64, 3), np.uint8)
    runner.prepare(ImageRequest("lora", "a cat", 64, 64, 2, 4.0, seed=1, loras=(("x", 1.0),)))
    runner.prepare(ImageRequest("control", "a cat", 64, 64, 2, 4.0, seed=1, controlnets=(("c", b"", 1.0),)),
                   controls=[control])
    runner.prepare(ImageRequest("plain", "a cat", 64, 64, 2, 4.0, seed=1))
    # the loader thread read it (and failed)
    assert runner.lora_runtime.store.load("x").exception(timeout=60) is not None
    out = runner.execute(Batch(("lora", "control", "plain")))
    assert out.request_ids == ["plain"] and out.invalid == {"lora": "loras", "control": "controlnets"}
    assert "not a readable safetensors file" in out.failed["lora"] and "could not be loaded" in out.failed["control"]


def test_no_reader_of_users_files_maps_them():
    """The class of item 1: every user's file is read whole through gouache.files. Mapping
    readers (safetensors' safe_open/load_file, diffusers' from_pretrained, torch.load of a path)
    appear only where the served model's own weights are loaded at start."""
    import re
    from pathlib import Path

    import gouache

    root = Path(gouache.__file__).parent
    mapping = re.compile(r"\b(safe_open|load_file|from_pretrained)\(|torch\.load\((?!io\.BytesIO)")
    found = {str(path.relative_to(root)) for path in root.rglob("*.py") if mapping.search(path.read_text())}
    assert found == {"models/trained.py", "models/zoo.py"}

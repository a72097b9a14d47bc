"""The stages beside the engine loop: a batched stage hands its handler every job waiting, and a
batch that raises runs again one job at a time so that only a failing job fails; decoding
several images at once equals decoding each alone within one uint8 level."""

import threading

import numpy as np

from gouache.engine.stages import Stage
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.uploads import EditMask, Upload


def test_a_batched_stage_takes_every_waiting_job_and_isolates_a_failing_one():
    entered, gate, calls, failed = threading.Event(), threading.Event(), [], []

    def handler(jobs):
        entered.set()
        gate.wait(10)
        calls.append([job[0] for job in jobs])
        if "bad" in [job[0] for job in jobs]:
            raise ValueError("bad job")

    stage = Stage("test", handler, lambda job, error: failed.append((job[0], str(error))), batched=True)
    stage.start()
    stage.put("first")
    assert entered.wait(10)
    for name in ("a", "bad", "b"):
        stage.put(name)
    gate.set()
    stage.stop()
    # the first job alone (the others came while it waited), then the rest together; that batch
    # raised, so each of them ran alone
    assert calls == [["first"], ["a", "bad", "b"], ["a"], ["bad"], ["b"]]
    assert failed == [("bad", "bad job")]


def test_decoding_images_together_equals_decoding_each_alone():
    runner = ModelRunner(load_pipeline("tiny-sd"))
    sizes = [(64, 64), (64, 64), (96, 64), (64, 64)]
    mask = np.zeros((64, 64), np.float32)
    mask[16:48, 16:48] = 1.0
    for i, (h, w) in enumerate(sizes):
        image = np.full((h, w, 3), 40 * i, np.uint8) if i == 3 else None
        runner.prepare(ImageRequest(f"r{i}", "a cat", w, h, 2, 4.0, seed=i, image=b"-" if image is not None else None),
                       None if image is None else Upload(image, EditMask(mask)))
    ids = [f"r{i}" for i in range(len(sizes))]
    together = runner.decode_many([(rid, None) for rid in ids] + [("gone", None)])
    assert together[-1] is None  # a request released meanwhile
    for rid, image in zip(ids, together):
        alone = runner.decode(rid)
        assert image.shape == alone.shape
        assert np.abs(image.astype(int) - alone.astype(int)).max() <= 1, rid
    assert (together[3][:16] == 120).all()  # the edit's kept pixels

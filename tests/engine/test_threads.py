"""One OpenMP team (`gouache.threads`, docs/speed.md): the step thread runs torch on the server's
threads, the stages on one, and the start's work in a thread that ends."""

import asyncio
import threading

import pytest
import torch

from gouache.engine.stages import Stage
from gouache.threads import in_thread, step_threads

from .test_async_engine import images, make_engine


def test_in_thread_runs_on_its_threads_in_a_thread_that_ends_and_hands_back_what_it_raised():
    seen = {}

    def work():
        seen["thread"], seen["threads"] = threading.current_thread(), torch.get_num_threads()
        return 7

    assert in_thread(work, 3, "test-start") == 7
    assert seen["threads"] == 3 and seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()
    with pytest.raises(ValueError, match="bad model"):
        in_thread(lambda: (_ for _ in ()).throw(ValueError("bad model")), 2, "test-start")
    assert step_threads(5) == 5 and step_threads(None) == torch.get_num_threads()


def test_a_stage_runs_torch_on_one_thread():
    seen = []
    stage = Stage("test", lambda job: seen.append(torch.get_num_threads()), lambda job, error: None)
    stage.start()
    stage.put("job")
    stage.stop()
    assert seen == [1]


def test_the_engine_steps_on_its_torch_threads_and_prepares_and_decodes_on_one(pipes):
    engine = make_engine(pipes, torch_threads=3)
    seen: dict[str, set[int]] = {"prepare": set(), "execute": set(), "decode_many": set()}
    for name in seen:
        method = getattr(engine.runner, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            seen[_name].add(torch.get_num_threads())
            return _method(*args, **kwargs)

        setattr(engine.runner, name, counted)

    serve_one(engine, "t")
    assert seen == {"prepare": {1}, "execute": {3}, "decode_many": {1}}


def test_the_warm_up_runs_on_the_thread_that_steps(pipes, monkeypatch):
    """torch keeps CUDA graphs and dynamo's settings per thread: a compiled model warmed up on
    another thread than its steps' would record its graphs again there (`EngineCore.call`)."""
    from gouache.runner.model_runner import ModelRunner

    seen = {}
    warm_up = ModelRunner.warm_up

    def noted(runner, size):
        seen["warm-up"] = threading.current_thread()
        return warm_up(runner, size)

    monkeypatch.setattr(ModelRunner, "warm_up", noted)
    engine = make_engine(pipes)
    execute = engine.runner.execute

    def stepped(*args, **kwargs):
        seen["step"] = threading.current_thread()
        return execute(*args, **kwargs)

    engine.runner.execute = stepped

    serve_one(engine, "w")
    assert seen["warm-up"] is seen["step"] and seen["step"].name == "gouache-engine"


def serve_one(engine, api_id: str) -> None:
    """Start `engine`, serve one request of two steps, close it."""
    async def go():
        await engine.start()
        try:
            await (await engine.submit(images(api_id, steps=2))).images()
        finally:
            await engine.aclose()

    asyncio.run(go())

"""Fixtures of the LoRA, ControlNet and user-file tests: the module's `model` (a fixture each
such module gives), its pipeline, and a directory of two random ControlNets of it. Tests marked
`gpu` are skipped where torch sees no CUDA device (pyproject.toml declares the markers).

Under pytest-xdist (`make test` runs `-n 2`): a test file is one unit of work, run whole by one
worker (its module fixtures, servers and compiles built once), and the Ray files share a unit (a
second Ray on the machine would join the first one's cluster). Units go out longest first, so
that the run does not end on one worker alone with a long file. Each worker runs its own torch
operators on one thread, and so do the processes it starts unless told otherwise: two workers
with torch's default of one thread per core would hold more OpenMP threads than the machine has
cores (gouache/threads.py tells what that costs)."""

import os

import pytest
import torch

from gouache.controlnet.model import random_controlnet
from gouache.models.zoo import load_pipeline


@pytest.fixture(scope="module")
def pipe(model):
    return load_pipeline(model)


@pytest.fixture(scope="module")
def control_dir(pipe, tmp_path_factory):
    directory = tmp_path_factory.mktemp("controlnets")
    for seed, name in enumerate(("edges", "depth")):
        random_controlnet(pipe, seed=seed, std=0.2).save_pretrained(str(directory / name))
    return directory


@pytest.fixture(autouse=True)
def pil_pixel_limit():
    """PIL's limit on an image's pixels, as it was before each test. gouache.engine.imaging sets
    it, process-wide, to the max_pixels of the decode it runs: a test decoding under a small limit
    left it there, and a later test in the process had its own images refused as decompression
    bombs (first seen when pytest-xdist ran files in another order)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = limit


# Seconds each file took in `make test` on 2 cores (the files over ~5 s): the order units go out
# in, longest first. A file not named here counts UNLISTED_S a test. Only the order depends on
# these, never a test's outcome; refresh them from `--durations=0` when the slow files change.
FILE_SECONDS = {
    "tests/engine/test_exactness.py": 164, "tests/ui/test_playground.py": 153, "tests/api/test_real_server.py": 142,
    "tests/runner/test_compiled.py": 290, "tests/runner/test_background.py": 100,
    "tests/engine/test_compose.py": 100, "tests/bench/test_fullsize.py": 93, "tests/engine/test_qwen_image.py": 83,
    "tests/bench/test_gpu_script.py": 50,
    "tests/test_cli.py": 64, "tests/runner/test_compile_cache.py": 54, "tests/parallel/test_ulysses.py": 46,
    "tests/train/test_command.py": 44, "tests/controlnet/test_service.py": 43, "tests/api/test_lifecycle.py": 42,
    "tests/controlnet/test_model.py": 41, "tests/engine/test_preemption.py": 40, "tests/bench/test_fidelity.py": 38,
    "tests/runner/test_pieces.py": 34, "tests/replicas/test_replica_faults.py": 33, "tests/bench/test_soak.py": 27,
    "tests/executor/test_multiproc.py": 26, "tests/parallel/test_cfg.py": 25,
    "tests/engine/test_instruction_edits.py": 26, "tests/api/test_edge_values.py": 26,
    "tests/replicas/test_replicas.py": 25, "tests/lora/test_runtime.py": 25, "tests/api/test_fuzz.py": 24,
    "tests/engine/test_family_load.py": 24, "tests/engine/test_block_cache.py": 21,
    "tests/files/test_user_files.py": 18, "tests/bench/test_adapters.py": 15, "tests/engine/test_flux2.py": 15,
    "tests/templates/test_replay.py": 15, "tests/models/test_zoo.py": 14, "tests/block_cache/test_blocks.py": 12,
    "tests/engine/test_supervision.py": 11, "tests/bench/test_speed.py": 11, "tests/sim/test_simulator.py": 10,
    "tests/engine/test_edits.py": 10, "tests/engine/test_async_engine.py": 9, "tests/sim/test_fleet_day.py": 8,
    "tests/test_children.py": 7, "tests/engine/test_templates.py": 7, "tests/sim/test_replicas.py": 6,
    "tests/engine/test_controlnets.py": 5,
}
UNLISTED_S = 0.1
# Files run by one worker together, one after the other: each starts a local Ray (ray.init() joins
# a cluster already running on the machine, and would find the other file's).
SHARED_UNITS = {"tests/executor/test_ray.py": "ray", "tests/executor/test_ray_multinode.py": "ray"}

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    # and the processes the tests start (servers, workers, compiles), unless a test or the caller
    # names a count: two of them at once, one a worker, already fill the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


def seconds(nodeids) -> float:
    """What a unit of these tests is expected to take."""
    files: dict[str, int] = {}
    for nodeid in nodeids:
        path = nodeid.split("::", 1)[0]
        files[path] = files.get(path, 0) + 1
    return sum(FILE_SECONDS.get(path, UNLISTED_S * count) for path, count in files.items())


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, absent without it
def pytest_xdist_make_scheduler(config, log):
    """Whole files (and SHARED_UNITS) as units of work, the longest first, whatever --dist asked
    of load, loadscope, loadfile and loadgroup (none of which keeps a file, let alone two, on one
    worker while putting long files first)."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFilesFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda unit: seconds(self.workqueue[unit]))
            self.workqueue.move_to_end(longest, last=False)  # the one the base class hands out next
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # ours orders them
    return LongestFilesFirst(config, log)


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none")
        for item in gpu:
            item.add_marker(skip)

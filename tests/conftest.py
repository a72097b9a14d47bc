"""Fixtures of the LoRA, ControlNet and user-file tests: the module's `model` (a fixture each
such module gives), its pipeline, and a directory of two random ControlNets of it. Tests marked
`gpu` are skipped where torch sees no CUDA device (pyproject.toml declares the markers)."""

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


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none")
        for item in gpu:
            item.add_marker(skip)

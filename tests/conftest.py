"""Fixtures of the LoRA, ControlNet and user-file tests: the module's `model` (a fixture each
such module gives), its pipeline, and a directory of two random ControlNets of it."""

import pytest

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

import torch

from gouache.models import trained
from gouache.train.loop import Schedule, flow_sigmas, shapes_batch


def test_a_batch_depends_on_seed_and_step_alone():
    a, b = shapes_batch(0, 5, 4, trained.TRAIN_SIZES), shapes_batch(0, 5, 4, trained.TRAIN_SIZES)
    assert torch.equal(a.pixels, b.pixels) and a.captions == b.captions
    assert not torch.equal(a.pixels, shapes_batch(1, 5, 4, trained.TRAIN_SIZES).pixels)
    assert a.pixels.shape[:2] == (4, 3) and (a.pixels.shape[3], a.pixels.shape[2]) in trained.TRAIN_SIZES
    assert -1.0 <= a.pixels.min() and a.pixels.max() <= 1.0


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    s = Schedule(steps=1000, lr=1.0, warmup=100, final_lr_fraction=0.1)
    assert s.lr_at(0) == 0.01 and s.lr_at(99) == 1.0
    assert s.lr_at(100) == 1.0 > s.lr_at(500) > s.lr_at(999) >= 0.1


def test_weights_round_trip_through_fp16_safetensors(tmp_path):
    torch.manual_seed(0)
    vae = trained.vae()
    trained.save_weights({"vae": vae}, "shapes-vae", tmp_path,
                         metadata={"scaling_factor": "2.0", "shift_factor": "0.5"})
    loaded = trained.load_vae(tmp_path)
    assert (loaded.config.scaling_factor, loaded.config.shift_factor) == (2.0, 0.5)
    for (name, a), b in zip(vae.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.half().float(), b), name


def test_flow_sigmas_are_logit_normal_draws_shifted_as_the_sampler_shifts():
    draws = {shift: flow_sigmas(200_000, shift, torch.Generator().manual_seed(0), "cpu") for shift in (1.0, 3.0)}
    u = draws[1.0]  # shift 1: the logit-normal draws themselves, the same numbers for every shift
    assert torch.allclose(draws[3.0], 3 * u / (1 + 2 * u))
    assert 0 < u.min() and u.max() < 1 and abs(u.median().item() - 0.5) < 0.01
    assert abs((draws[3.0] < 0.5).float().mean().item() - 0.136) < 0.005  # shift 3: few low noise levels

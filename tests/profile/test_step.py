from gouache.profile.step import compositions


def test_every_composition_is_timed_when_there_are_few():
    mixes = compositions([256, 384], n=40, max_batch=3, seed=0)
    assert mixes == [{256: 1}, {384: 1}, {256: 2}, {256: 1, 384: 1}, {384: 2},
                     {256: 3}, {256: 2, 384: 1}, {256: 1, 384: 2}, {384: 3}]


def test_random_mixes_after_the_singles_when_there_are_many():
    mixes = compositions([256, 384, 512], n=20, max_batch=6, seed=0)  # 83 compositions exist
    assert len(mixes) == 20
    assert mixes[:3] == [{256: 1}, {384: 1}, {512: 1}]
    assert all(1 <= sum(m.values()) <= 6 and set(m) <= {256, 384, 512} for m in mixes)

"""`attend_segments` (gouache/attention.py): attention of each segment's queries over its own keys
and values, its cuts a tensor, so one compiled graph around it serves every mix of segments."""

import torch
import torch._dynamo.utils
import torch.nn.functional as F

from gouache.attention import attend_segments


def per_segment(q, k, v, q_cuts, kv_cuts) -> torch.Tensor:
    out = []
    for a, b, c, d in zip(q_cuts, q_cuts[1:], kv_cuts, kv_cuts[1:]):
        heads = (x.transpose(0, 1) for x in (q[a:b], k[c:d], v[c:d]))  # [H, S, d]
        out.append(F.scaled_dot_product_attention(*heads).transpose(0, 1).flatten(1))
    return torch.cat(out)


def segments(q_cuts, kv_cuts, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_cuts[-1], heads, dim, generator=g)
    k, v = (torch.randn(kv_cuts[-1], heads, dim, generator=g) for _ in range(2))
    return q, k, v, torch.tensor(q_cuts), torch.tensor(kv_cuts)


def test_each_segment_attends_to_its_own_keys_only():
    """Queries and keys cut apart, cut alike, and a segment without queries."""
    for q_cuts, kv_cuts in (([0, 3, 10], [0, 5, 12]), ([0, 4, 8, 12], [0, 4, 8, 12]), ([0, 2, 2, 7], [0, 3, 6, 9])):
        inputs = segments(q_cuts, kv_cuts)
        got = attend_segments(*inputs)
        assert got.shape == (q_cuts[-1], 8)
        assert (got - per_segment(*inputs[:3], q_cuts, kv_cuts)).abs().max() <= 1e-6
    # without its cuts the batch would be one segment: the comparison above tells them apart
    q, k, v, qc, kc = segments([0, 3, 10], [0, 5, 12])
    whole = attend_segments(q, k, v, torch.tensor([0, 10]), torch.tensor([0, 12]))
    assert (whole - attend_segments(q, k, v, qc, kc)).abs().max() > 1e-2


def test_one_compiled_graph_serves_every_mix_of_segments():
    """Dynamo does not trace into the operator: the graph around it (here with dynamic shapes, as
    a patched UNet's) is one for mixes of other token and segment counts."""
    graph = torch.compile(lambda q, k, v, qc, kc: attend_segments(q * 2, k, v, qc, kc).relu(), dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for q_cuts, kv_cuts in (([0, 3, 10], [0, 5, 12]), ([0, 4, 9, 12, 20], [0, 2, 6, 7, 11]), ([0, 6, 13], [0, 6, 13])):
        q, k, v, qc, kc = segments(q_cuts, kv_cuts)
        expected = per_segment(q * 2, k, v, q_cuts, kv_cuts).relu()
        assert (graph(q, k, v, qc, kc) - expected).abs().max() <= 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1

"""A tensor-parallel rank's share of a GPTQ checkpoint under activation order (``desc_act``):
o's and down's input columns are split over the ranks while each group's columns are spread
over all of them, so every rank regroups its columns (``repacked.regroup``: sorted by group,
each group's run padded to whole sub-groups with exact zeros). Each rank's layers, loaded as
it loads them, equal the checkpoint's dequantized weights' columns of its share, the forward
pass included (the compiled kernel at groups of 32 and 64, the torch path at 16)."""

from __future__ import annotations

import pytest
import torch
from awq_gptq_layouts import reference_weights, write_gptq
from support.tiny_models import make_tiny_model

from loramux.engine.distributed.shard import TensorShard
from loramux.engine.model.registry import load_model


@pytest.mark.parametrize("bits,group", [(4, 16), (4, 32), (8, 32), (4, 64)])
def test_each_ranks_regrouped_share_is_the_checkpoints_columns(bits, group, tmp_path, default_model_dir):
    dense = make_tiny_model(tmp_path / "dense", default_model_dir, "qwen3")
    folder = write_gptq(dense, tmp_path / "q", bits=bits, group_size=group, desc_act=True, sym=bits == 4)
    ref = reference_weights(folder)
    g = torch.Generator().manual_seed(0)
    for rank in range(2):
        model = load_model(folder, torch.float32, torch.device("cpu"), tensor_parallel=(rank, 2))
        shard = TensorShard(rank, 2, model.dims)
        for i, layer in enumerate(model.layers):
            for attr, module in (("o", "self_attn.o_proj"), ("down", "mlp.down_proj")):
                lin = getattr(layer, attr) if attr == "o" else layer.mlp.down
                a, b = shard.in_range(module.split(".")[-1])
                want = ref[f"model.layers.{i}.{module}"][:, a:b]  # [out, share]
                assert lin.scheme.kernel_in is not None and lin.kernel_in_features >= b - a  # regrouped
                got = torch.cat([w for _, _, w in lin.bands()])
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
                x = torch.randn(5, b - a, generator=g)
                torch.testing.assert_close(lin(x), x @ want.T, rtol=1e-4, atol=1e-4)

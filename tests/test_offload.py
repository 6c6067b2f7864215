"""model.offload_frozen: frozen weights kept in host memory and streamed to the device a block ahead of use.

On a CPU the device is the host, so no byte moves; what is checked is the bookkeeping a GPU relies on: which
blocks are on the device when, how many copies a step makes, and that the computation is the same."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from sdtrain.cli.main import main
from sdtrain.models.frozen import store_frozen
from sdtrain.models.offload import WeightStream

from .conftest import TINY, config_path

BLOCKS = 5


class _Model(nn.Module):
    """Blocks of frozen linear layers, with a trained scale before each, as adapters train over a frozen base."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                    for _ in range(BLOCKS))
        self.scales = nn.Parameter(torch.ones(BLOCKS, 16))

    def forward(self, x: torch.Tensor, checkpointed: bool, seen: list[set[int]] | None = None,
                stream: WeightStream | None = None) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = x * self.scales[index]
            x = x + (checkpoint(block, x, use_reentrant=False) if checkpointed else block(x))
            if seen is not None:
                seen.append(set(stream.resident))
        return x


def _pair(precision: str) -> tuple[_Model, _Model]:
    torch.manual_seed(0)
    plain, streamed = _Model(), _Model()
    streamed.load_state_dict(plain.state_dict())
    for model in (plain, streamed):
        model.blocks.requires_grad_(False)
        store_frozen(model, precision)
    return plain, streamed


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "nf4"])
def test_streamed_blocks_compute_the_same_with_two_blocks_on_the_device_at_most(precision, checkpointed):
    plain, streamed = _pair(precision)
    stream = WeightStream(list(streamed.blocks), torch.device("cpu"))
    # The bits are no longer buffers: moving the model to the GPU leaves them in host memory.
    assert not any("weight_stored" in name for name, _ in streamed.named_buffers())
    x = torch.randn(4, 16)
    expected = plain(x, checkpointed)
    expected.square().sum().backward()
    seen: list[set[int]] = []
    out = streamed(x, checkpointed, seen, stream)
    # Forward: each block's turn finds it and the next on the device, and nothing else.
    assert seen == [{i, i + 1} & set(range(BLOCKS)) for i in range(BLOCKS)]
    out.square().sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(streamed.scales.grad, plain.scales.grad)
    assert stream.most_resident == 2
    # Each block once forward and once backward; the last one stays from the forward to the backward.
    assert stream.copies == 2 * BLOCKS - 1


def test_a_lora_over_an_offloaded_fp8_base_trains_as_over_one_on_the_device(tmp_path: Path, pretrained, shapes_dir,
                                                                           caplog):
    files = {}
    for offload in ("auto", "true"):  # auto never offloads on a CPU
        run = tmp_path / offload
        with caplog.at_level(logging.INFO, logger="sdtrain"):
            assert main(["train", str(config_path("diffusion.yaml").parents[1] / "lora.yaml"), f"run_dir={run}",
                         *TINY, "data.batch_size=2", "validation.prompts=[]", "evaluation.every_samples=0",
                         f"model.pretrained={pretrained}", f"data.shards={shapes_dir}", "train.max_steps=2",
                         "optim.lr=0.01", "train.gradient_checkpointing=true", "model.frozen_precision=fp8",
                         f"model.offload_frozen={offload}"]) == 0
        streamed = [r.getMessage() for r in caplog.records if "model.offload_frozen" in r.getMessage()]
        assert bool(streamed) == (offload == "true"), streamed
        caplog.clear()
        files[offload] = load_file(next((run / "checkpoints" / "step_00000002").glob("*.safetensors")))
    assert files["true"].keys() == files["auto"].keys()
    assert all(torch.equal(files["true"][k], files["auto"][k]) for k in files["auto"])


def test_offloading_what_is_not_stored_low_is_one_line(tmp_path, capsys):
    assert main(["train", str(config_path("diffusion.yaml").parents[1] / "lora.yaml"), f"run_dir={tmp_path}",
                 "data.shards=absent", f"model.pretrained={tmp_path / 'absent'}", "model.offload_frozen=true"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "model.offload_frozen: streams the weights frozen_precision stores low" in error[0]

"""FID and CLIP score: torchmetrics' formulas on the MLPerf networks, here randomly initialised and saved by
the test (no weights can be downloaded), checked for the properties a user relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdtrain.errors import UserError
from sdtrain.evaluate.inception import FIDInception, load_fid_inception
from sdtrain.evaluate.metrics import (
    ReferenceStats,
    clip_metric,
    fid_between,
    fid_metric,
    reference_stats,
    use_reference,
)


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    torch.manual_seed(0)
    network = FIDInception()
    # Random BatchNorm statistics: a fresh network's are 0 and 1, which makes every feature alike.
    for module in network.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("weights") / "inception.pth"
    torch.save(network.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def inception(inception_file):
    return load_fid_inception(inception_file)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny random CLIP in transformers' layout, with a tokenizer of the shapes captions."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from sdtrain.models.tokenizer import train_clip_tokenizer

    tmp_path = tmp_path_factory.mktemp("clip")
    tokenizer = train_clip_tokenizer(["a red circle", "a blue square", "a green triangle and a yellow circle"] * 10,
                                     tmp_path / "tok", 600, 16)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    folder = tmp_path / "model"
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    processor.save_pretrained(folder)
    return folder


def _images(seed: int, count: int = 24, side: int = 64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    base = torch.rand(count, 3, 1, 1, generator=generator)  # flat colours with some texture
    return (base + 0.2 * torch.rand(count, 3, side, side, generator=generator)).clamp(0, 1)


def _fid(inception, real: torch.Tensor, fake: torch.Tensor) -> float:
    metric = fid_metric(inception)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return float(metric.compute())


# 40 s of Inception features; FID through the CLI runs in the default suite (test_evaluate_from_the_cli_...).
@pytest.mark.slow
def test_fid_of_a_set_with_itself_is_zero_and_grows_with_noise(inception):
    images = _images(0)
    assert abs(_fid(inception, images, images)) < 1e-3
    distances = [_fid(inception, images, (images + noise * torch.randn_like(images)).clamp(0, 1))
                 for noise in (0.05, 0.2, 0.5)]
    assert 0 < distances[0] < distances[1] < distances[2]


@pytest.mark.slow
def test_fid_from_two_stats_files_equals_the_fid_of_the_image_sets(inception, tmp_path):
    real, fake = _images(1), _images(2)
    files = []
    for name, images in (("real", real), ("fake", fake)):
        metric = fid_metric(inception)
        metric.update(images, real=True)
        files.append(reference_stats(metric).save(tmp_path / f"{name}.npz"))
    a, b = (ReferenceStats.load(f) for f in files)
    direct = _fid(inception, real, fake)
    assert fid_between(a, b) == pytest.approx(direct, rel=1e-4)
    metric = fid_metric(inception)  # reference statistics instead of reference images
    use_reference(metric, a)
    metric.update(fake, real=False)
    assert float(metric.compute()) == pytest.approx(direct, rel=1e-4)


def test_missing_or_wrong_weights_are_one_clear_line(tmp_path):
    with pytest.raises(UserError, match="pt_inception-2015-12-05"):
        load_fid_inception(None)
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="not the FID Inception weights"):
        load_fid_inception(tmp_path / "other.pth")
    (tmp_path / "bad.npz").write_bytes(b"nonsense")
    with pytest.raises(UserError, match="bad.npz"):
        ReferenceStats.load(tmp_path / "bad.npz")


def test_clip_score_is_the_mean_of_the_per_pair_scores(clip_folder):
    folder = clip_folder
    images = (_images(3, count=3, side=48) * 255).to(torch.uint8)
    captions = ["a red circle", "a blue square", "a green triangle"]
    metric = clip_metric(folder)
    per_pair = []
    for image, caption in zip(images, captions):
        single = clip_metric(folder)
        single.update(image.unsqueeze(0), [caption])
        per_pair.append(float(single.compute()))
    metric.update(images, captions)
    assert float(metric.compute()) == pytest.approx(np.mean(per_pair), rel=1e-4)
    with pytest.raises(UserError, match="CLIP"):
        clip_metric(None)


def _evaluate_cli(tmp_path, pretrained, inception_file, clip_folder, prompts, *extra: str) -> list[str]:
    return ["evaluate", str(pretrained), "--prompts", str(prompts), "--metrics", "fid,clip,adherence",
            "--reference", str(tmp_path / "stats.npz"), "--inception", str(inception_file), "--clip",
            str(clip_folder), "--steps", "2", "--batch", "2", *extra]


def test_evaluate_from_the_cli_writes_fid_clip_and_adherence(tmp_path, pretrained, shapes_dir, inception_file,
                                                             clip_folder, capsys):
    import json

    from sdtrain.cli.main import main

    assert main(["evaluate", "stats", str(shapes_dir), "--out", str(tmp_path / "stats.npz"), "--inception",
                 str(inception_file), "--resolution", "32"]) == 0
    assert ReferenceStats.load(tmp_path / "stats.npz").count == 48
    prompts = tmp_path / "prompts.tsv"
    prompts.write_text("id\tcaption\n" + "".join(f"{i}\t{c}\n" for i, c in enumerate(
        ["a red circle", "a blue square", "a green triangle", "a red square and a blue circle"])))
    out = tmp_path / "result.json"
    assert main([*_evaluate_cli(tmp_path, pretrained, inception_file, clip_folder, prompts), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["images"] == 4 and result["fid"] > 0 and 0 <= result["clip"] <= 1
    assert result["adherence"]["num_single"] == 3 and result["adherence"]["num_double"] == 1
    assert "FID" in capsys.readouterr().out
    assert main(["evaluate", str(pretrained), "--prompts", str(prompts), "--metrics", "fid"]) == 2  # no reference


IN_LOOP = ["evaluation.every_samples=8", "evaluation.metrics=[adherence]", "evaluation.num=2", "evaluation.steps=2",
           "evaluation.batch=2", "checkpoint.every=2", "validation.prompts=[]"]


def _evaluation_steps(run) -> list[int]:
    import json

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["step"] for line in lines if "adherence_overall" in line]


def test_in_loop_evaluation_reaches_a_target_and_stops_the_run(tmp_path, shapes_dir, autoencoder_run):
    import json

    from sdtrain.checkpoint import latest_checkpoint

    from .conftest import train

    run = tmp_path / "run"
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", "train.max_steps=8",
          *IN_LOOP, "evaluation.target.adherence_count_accuracy=0.0")
    reached = json.loads((run / "target.json").read_text())
    assert (reached["step"], reached["samples"]) == (2, 8) and reached["seconds"] > 0
    assert latest_checkpoint(run).name == "step_00000002"  # stopped there, saved
    assert _evaluation_steps(run) == [2]


def test_in_loop_evaluation_survives_a_resume(tmp_path, shapes_dir, autoencoder_run):
    from .conftest import train

    common = [f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *IN_LOOP]
    train("diffusion.yaml", tmp_path / "straight", *common, "train.max_steps=4")
    train("diffusion.yaml", tmp_path / "split", *common, "train.max_steps=2")
    train("diffusion.yaml", tmp_path / "split", *common, "train.max_steps=4")
    assert _evaluation_steps(tmp_path / "straight") == _evaluation_steps(tmp_path / "split") == [2, 4]


@pytest.mark.slow
@pytest.mark.dist
def test_evaluation_under_two_gloo_ranks_gives_the_numbers_of_one(tmp_path, pretrained, shapes_dir, inception_file,
                                                                  clip_folder):
    import json
    import os
    import signal
    import subprocess
    import sys

    from sdtrain.cli.main import main

    assert main(["evaluate", "stats", str(shapes_dir), "--out", str(tmp_path / "stats.npz"), "--inception",
                 str(inception_file), "--resolution", "32"]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\na yellow circle and a red square\n"
                       "an orange square\n")
    args = _evaluate_cli(tmp_path, pretrained, inception_file, clip_folder, prompts)
    assert main([*args, "--out", str(tmp_path / "one.json")]) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "sdtrain", *args, "--out", str(tmp_path / "two.json")]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
    assert process.returncode == 0, err[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["world_size"] == 2 and two["images"] == one["images"] == 5
    # Same images (seeded by prompt index, in the same blocks): only rounding differs, as the ranks run on one
    # thread each, and the order in which sums are added.
    assert two["fid"] == pytest.approx(one["fid"], rel=1e-4)
    assert two["clip"] == pytest.approx(one["clip"], rel=1e-4)
    assert two["adherence"] == one["adherence"]

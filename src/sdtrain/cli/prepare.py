"""`sdtrain prepare`: turn data into WebDataset shards with a manifest, and check such a folder."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
from pathlib import Path

FILTER_HELP = (
    "keep only samples whose json metadata passes KEY=COND (repeatable), e.g. pwatermark=<=0.5, "
    "punsafe=<0.1, status=success, min_width=256, max_aspect=2, min_caption_length=5"
)
OUT_HELP = "output folder for shards and manifest.json (shards of an earlier run there are replaced)"
# The same values as sdtrain.data.prepare's (a test checks), kept here so building the parser for any command
# doesn't import webdataset and PIL.
DEFAULT_MAX_PIXELS = 89_478_485
MISSING_CAPTION = ("skip", "empty")
DEDUP_MODES = ("exact", "perceptual", "none")
# sdtrain.data.video's, likewise (it imports PyAV).
VIDEO_EXTENSIONS = (".mp4", ".mov", ".webm", ".mkv")
FRAME_RULES = ("head", "chunk", "slide", "uniform")
DEFAULT_FRAMES = 81
DEFAULT_FPS = 16.0
DEFAULT_FRAME_STEP = 4
DEFAULT_WINDOWS = 4


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("prepare", help="write training shards")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="SOURCE")
    shapes = kinds.add_parser("shapes", help="the embedded demo dataset: coloured shapes with exact captions")
    shapes.add_argument("--out", type=Path, required=True, help="output folder for shards and manifest.json")
    shapes.add_argument("--num", type=int, default=2000, help="number of samples")
    shapes.add_argument("--seed", type=int, default=0, help="seed; the same seed gives identical shards")
    shapes.add_argument("--size", type=int, default=64, help="image side in pixels")
    shapes.add_argument("--samples-per-shard", type=int, default=1000)
    shapes.add_argument("--two-shape-fraction", type=float, default=0.5,
                        help="share of samples with two shapes (the rest have one)")
    shapes.add_argument("--conditioning", choices=("layout",),
                        help="also write each sample's layout map (each shape's silhouette in its colour on black), "
                             "its conditioning image for ControlNet training")
    shapes.set_defaults(run=run_shapes)

    def add_checks(p: argparse.ArgumentParser) -> None:
        p.add_argument("--missing-caption", choices=MISSING_CAPTION, default="skip",
                       help="a sample without a caption (or an empty one) is skipped (default) or kept with ''")
        p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, metavar="N",
                       help="skip images (and videos whose frames have) more pixels than this, read from the header "
                            f"before decoding (default {DEFAULT_MAX_PIXELS})")
        p.add_argument("--filter", action="append", default=[], metavar="KEY=COND", help=FILTER_HELP)
        p.add_argument("--dedup", choices=DEDUP_MODES, default="exact",
                       help="drop images that repeat an earlier one: exact (the same bytes; default), perceptual "
                            "(also re-encoded or resized copies, by a perceptual hash; pip install 'sdtrain[dedup]') "
                            "or none")
        p.add_argument("--dedup-distance", type=int, default=4, metavar="BITS",
                       help="--dedup perceptual: the most bits of 64 two hashes may differ by (default 4)")
        p.add_argument("--min-width", type=int, metavar="N", help="same as --filter min_width=N")
        p.add_argument("--min-height", type=int, metavar="N", help="same as --filter min_height=N")

    folder = kinds.add_parser(
        "folder", help="a folder of images and videos with captions beside them, or with a metadata.jsonl/metadata.csv",
        description="Images (jpg, jpeg, png, webp, gif, tif; nested folders) and videos (mp4, mov, webm, mkv) with a "
                    "caption file beside each (a.jpg + a.txt; several lines are several captions), "
                    "or a metadata.jsonl / metadata.csv at the folder's root with file_name, text (or caption) "
                    "and any other columns. Images are stored unchanged; videos are resampled to --fps and cut into "
                    "windows of --frames frames by --frame-rule, each window a sample. Corrupt, oversized, "
                    "uncaptioned and duplicate inputs (and videos shorter than one window) are skipped and counted.")
    folder.add_argument("src", type=Path, metavar="SRC", help="the image folder")
    folder.add_argument("--out", type=Path, required=True, metavar="DIR", help=OUT_HELP)
    folder.add_argument("--samples-per-shard", type=int, default=1000, metavar="N", help="default 1000")
    folder.add_argument("--caption-ext", default="txt", metavar="EXT",
                        help="extension of the caption files (default txt)")
    folder.add_argument("--caption-column", action="append", default=[], metavar="NAME",
                        help="a metadata column holding captions (repeat for several: each sample then has several, "
                             "one drawn per epoch); default text, else caption")
    folder.add_argument("--conditioning", choices=("canny",), metavar="KIND",
                        help="give each sample without a KEY.cond.png a conditioning image computed from its image: "
                             "canny (edge maps, for ControlNet training; pip install 'sdtrain[control]')")
    add_checks(folder)
    clips = folder.add_argument_group(
        "videos", f"how {', '.join(VIDEO_EXTENSIONS)} files become clips: resampled to --fps by their timestamps, "
                  "then cut into windows of --frames frames, each window a sample")
    clips.add_argument("--frames", type=int, default=DEFAULT_FRAMES, metavar="N",
                       help=f"frames per window (default {DEFAULT_FRAMES}: 5 s at 16 fps); 1 + a multiple of "
                            "--frame-step")
    clips.add_argument("--fps", type=float, default=DEFAULT_FPS, metavar="F",
                       help=f"frame rate videos are resampled to, dropping or repeating frames by their timestamps "
                            f"(default {DEFAULT_FPS:g}, Wan's); 0 keeps every frame of the source")
    clips.add_argument("--frame-rule", choices=FRAME_RULES, default="head",
                       help="which windows of a video: head (the first; default), chunk (consecutive windows, the "
                            "rest dropped), slide (a window every --frame-stride frames), uniform (--windows windows "
                            "spread evenly over the video); all but head key each window KEY_w000, KEY_w001, ...")
    clips.add_argument("--windows", type=int, default=DEFAULT_WINDOWS, metavar="K",
                       help=f"--frame-rule uniform: windows per video (default {DEFAULT_WINDOWS})")
    clips.add_argument("--frame-stride", type=int, metavar="S",
                       help="--frame-rule slide: frames from one window's start to the next's (default: --frames, "
                            "windows that touch)")
    clips.add_argument("--frame-step", type=int, default=DEFAULT_FRAME_STEP, metavar="K",
                       help=f"window lengths are 1 + a multiple of this (default {DEFAULT_FRAME_STEP}: Wan's 4n + 1; "
                            "1 allows any)")
    folder.set_defaults(run=run_folder)

    resh = kinds.add_parser(
        "reshard", help="re-tar existing WebDataset shards (e.g. img2dataset output) into even shards",
        description="Reads every sample of the given shards (folders, globs or brace lists; non-.tar files are "
                    "ignored), drops corrupt, oversized, uncaptioned, duplicate and filtered samples, and writes "
                    "the rest unchanged into shards of --samples-per-shard samples.")
    resh.add_argument("src", nargs="+", metavar="SRC", help="folder, glob or brace pattern of .tar shards")
    resh.add_argument("--out", type=Path, required=True, metavar="DIR", help=OUT_HELP)
    resh.add_argument("--samples-per-shard", type=int, required=True, metavar="N")
    add_checks(resh)
    resh.set_defaults(run=run_reshard)

    encode = kinds.add_parser(
        "encode", help="add each sample's VAE latent and text embedding, so training skips the encoders",
        description="Writes one shard per input shard: the same samples plus the VAE posterior (mean and std, "
                    "unscaled) of the centre-cropped image and the text embedding of the caption. Under torchrun, "
                    "Slurm or mpirun every process takes its share of the shards; finished shards are skipped on "
                    "a rerun and the last process to finish writes the manifest.")
    encode.add_argument("src", metavar="SRC", help="shard folder, glob or brace pattern")
    encode.add_argument("--model", help="a diffusers pipeline folder or sdtrain run: its VAE, and its text encoder "
                                        "and tokenizer when it has them; or a Hugging Face Hub id (org/name, "
                                        "org/name@REVISION; these three options alike), of which only the VAE, text "
                                        "encoders, tokenizers and configs are fetched, unless cached")
    encode.add_argument("--vae", help="the VAE from here instead: a component, pipeline or run folder, or a VAE file "
                                      "(ae.safetensors, sdxl_vae.safetensors), which takes the latent scaling of "
                                      "--model's VAE, else of --family's released models")
    encode.add_argument("--family", metavar="NAME",
                        help="the model family the latents are for (a model.family value), when --model does not say "
                             "(a VAE file alone)")
    encode.add_argument("--text-encoder", help="the text encoder (and tokenizer) from here instead")
    encode.add_argument("--no-text", action="store_true", help="latents only (for a text encoder still in training)")
    encode.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    encode.add_argument("--resolution", type=int,
                        help="image side the latents are taken at (default: the VAE's sample_size); training's "
                             "data.resolution must match it")
    encode.add_argument("--t5-text-length", type=int, default=None, metavar="N",
                        help="SD3 and Flux.1: tokens per caption of the T5 encoder (default: what the model samples "
                        "with: 256 for SD3 and Flux.1-schnell, 512 for Flux.1-dev, or the tokenizer's saved length "
                        "when shorter; never the 512 a released T5 tokenizer saves); training reads the same by "
                        "default, or set model.t5_text_length to match")
    encode.add_argument("--batch-size", type=int, default=32)
    encode.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                        help="storage type of latents and embeddings (default float16)")
    encode.add_argument("--device", default="auto", help="auto, cpu or cuda")
    encode.set_defaults(run=run_encode)

    urls = kinds.add_parser(
        "urls", help="download a parquet/CSV list of image URLs and captions with img2dataset",
        description="The LAION shape: url, caption and any other columns (width, height, pwatermark, punsafe...), "
                    "downloaded, resized and sharded by img2dataset; failures are counted by reason, never fatal. "
                    "A rerun finishes only the missing shards.")
    urls.add_argument("list", type=Path, metavar="LIST", help="a .parquet or .csv file")
    urls.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    urls.add_argument("--url-col", default="url")
    urls.add_argument("--caption-col", default="caption")
    urls.add_argument("--image-size", type=int, default=512)
    urls.add_argument("--resize-mode", default="keep_ratio", choices=("no", "border", "keep_ratio", "center_crop"))
    urls.add_argument("--min-image-size", type=int, default=0)
    urls.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, metavar="N",
                      help="skip images with more pixels than this, refused from the header before decoding "
                           f"(default {DEFAULT_MAX_PIXELS})")
    urls.add_argument("--processes", type=int, default=2)
    urls.add_argument("--threads", type=int, default=8)
    urls.add_argument("--samples-per-shard", type=int, default=1000)
    urls.set_defaults(run=run_urls)

    verify = kinds.add_parser("verify", help="check a shard folder against its manifest.json",
                              description="Checks that every shard the manifest lists exists, matches its sha256 "
                                          "and holds the listed number of samples. Exit code 1 on any problem.")
    verify.add_argument("dir", type=Path, metavar="DIR", help="the dataset folder")
    verify.set_defaults(run=run_verify)


def run_shapes(args: argparse.Namespace) -> int:
    from sdtrain.data.shapes import write_shapes_dataset
    from sdtrain.errors import UserError

    if args.samples_per_shard < 1:
        raise UserError("--samples-per-shard: must be at least 1")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out: {args.out} is a file; choose a folder")

    manifest = write_shapes_dataset(args.out, num=args.num, seed=args.seed, size=args.size,
                                    samples_per_shard=args.samples_per_shard,
                                    two_shape_fraction=args.two_shape_fraction,
                                    layout=args.conditioning == "layout")
    print(f"wrote {manifest['total']} samples in {len(manifest['shards'])} shards to {args.out}")
    return 0


def filters_from_args(args: argparse.Namespace):  # -> sdtrain.data.filters.Filters
    """``--filter KEY=COND`` (in order) plus ``--min-width``/``--min-height`` as one parsed Filters."""
    from sdtrain.data.filters import FORMS, parse_filters
    from sdtrain.errors import UserError

    spec: dict[str, str | int] = {}

    def add(key: str, value: str | int, given: str) -> None:
        if key in spec:
            raise UserError(f"--filter: {key} is given twice ({given}); keep one")
        spec[key] = value

    for item in args.filter:
        key, sep, cond = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--filter {item!r}: expected KEY=COND, e.g. pwatermark=<=0.5 or min_width=256; {FORMS}")
        add(key.strip(), cond, f"--filter {item}")
    if args.min_width is not None:
        add("min_width", args.min_width, f"--min-width {args.min_width}")
    if args.min_height is not None:
        add("min_height", args.min_height, f"--min-height {args.min_height}")
    return parse_filters(spec)


def _print_report(report) -> None:
    for line in report.lines():
        print(line)


def run_folder(args: argparse.Namespace) -> int:
    from sdtrain.data.prepare import prepare_folder
    from sdtrain.data.video import FrameRule

    clips = FrameRule(frames=args.frames, fps=args.fps, rule=args.frame_rule, windows=args.windows,
                      stride=args.frame_stride, step=args.frame_step)
    report = prepare_folder(args.src, args.out, samples_per_shard=args.samples_per_shard,
                            caption_ext=args.caption_ext, missing_caption=args.missing_caption,
                            max_pixels=args.max_pixels, filters=filters_from_args(args),
                            caption_columns=args.caption_column or None, duplicates=duplicates_from_args(args),
                            conditioning=args.conditioning, clips=clips)
    _print_report(report)
    return 0


def duplicates_from_args(args: argparse.Namespace):
    from sdtrain.data.dedup import Duplicates

    return Duplicates(args.dedup, args.dedup_distance)


def run_reshard(args: argparse.Namespace) -> int:
    from sdtrain.data.prepare import reshard

    report = reshard(args.src, args.out, samples_per_shard=args.samples_per_shard,
                     missing_caption=args.missing_caption, max_pixels=args.max_pixels,
                     filters=filters_from_args(args), duplicates=duplicates_from_args(args))
    _print_report(report)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from sdtrain.data.shards import read_manifest, verify_shards

    problems = verify_shards(args.dir)
    for line in problems:
        print(f"{args.dir}: {line}")
    if problems:
        return 1
    manifest = read_manifest(args.dir)
    assert manifest is not None
    print(f"OK: {len(manifest['shards'])} shards, {manifest['total']} samples in {args.dir}")
    return 0


def run_encode(args: argparse.Namespace) -> int:
    from sdtrain.config import ModelConfig
    from sdtrain.data.encode import Encoder, encode_dataset
    from sdtrain.distributed import detect_topology
    from sdtrain.errors import UserError
    from sdtrain.run import resolve_device

    _resolve_encode_sources(args)
    vae = args.vae or args.model
    if vae is None:
        raise UserError("prepare encode: name the VAE with --model PIPELINE_OR_RUN or --vae FOLDER")
    text = None if args.no_text else (args.text_encoder or _text_encoder_of(args.model))
    if args.batch_size < 1:
        raise UserError("--batch-size: must be at least 1")
    if args.t5_text_length is not None and args.t5_text_length < 4:
        raise UserError("--t5-text-length: must be at least 4")
    topology = detect_topology()
    device = resolve_device(args.device, topology.local_rank)
    served = ModelConfig(pretrained=args.model, family=args.family)
    encoder = Encoder(vae, text, args.resolution, device, args.dtype, args.t5_text_length, served)
    manifest = encode_dataset(args.src, args.out, encoder, batch_size=args.batch_size, rank=topology.rank,
                              world_size=topology.world_size)
    if manifest is not None:
        what = "latents and text embeddings" if text else "latents"
        print(f"encoded {manifest['total']} samples ({what}) in {len(manifest['shards'])} shards to {args.out}")
    return 0


def _resolve_encode_sources(args: argparse.Namespace) -> None:
    """--model, --vae and --text-encoder given as Hub ids become their folders (or files) in the Hugging Face cache,
    fetched if not cached, with the weights of only the components encoding reads from each."""
    from sdtrain.models import hub

    pickles = hub.pickles_trusted()
    text = () if args.no_text or args.text_encoder else hub.TEXT_ENCODERS
    vae = () if args.vae else ("vae",)
    args.model = hub.resolve(args.model, "--model", (*vae, *text), pickles)
    args.vae = hub.resolve(args.vae, "--vae", ("vae",), pickles)
    args.text_encoder = hub.resolve(args.text_encoder, "--text-encoder", hub.TEXT_ENCODERS, pickles)


def _text_encoder_of(model: str | None) -> str | None:
    """The model's own text encoder when it has one (a pipeline, or a run that trained one)."""
    if model is None:
        return None
    from sdtrain.models import build

    kind = build.source_kind(model)
    if kind == "pipeline":
        return model if (Path(model) / "text_encoder").is_dir() else None
    if kind == "single_file":  # holds all three components; its tokenizer lies beside it
        return model
    if kind in ("run", "checkpoint"):
        from sdtrain.checkpoint import latest_checkpoint, read_meta

        checkpoint = Path(model) if kind == "checkpoint" else latest_checkpoint(Path(model))
        trained = read_meta(checkpoint)["modules"] if checkpoint else {}
        return model if "text_encoder" in trained else None
    return None


def run_urls(args: argparse.Namespace) -> int:
    from sdtrain.data.urls import prepare_urls

    summary = prepare_urls(args.list, args.out, url_col=args.url_col, caption_col=args.caption_col,
                           image_size=args.image_size, resize_mode=args.resize_mode,
                           min_image_size=args.min_image_size, max_pixels=args.max_pixels,
                           processes=args.processes, threads=args.threads,
                           samples_per_shard=args.samples_per_shard)
    print(f"downloaded {summary['succeeded']} of {summary['total']} images into {summary['shards']} shards "
          f"in {args.out}")
    for reason, count in sorted(summary["failed_by_reason"].items(), key=lambda item: -item[1]):
        print(f"  failed ({reason}): {count}")
    return 0

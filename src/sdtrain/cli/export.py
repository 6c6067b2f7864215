"""`sdtrain export RUN OUT` (a diffusers folder), or `sdtrain export RUN OUT.safetensors --single-file`."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="write a run's model as a diffusers folder or one .safetensors file")
    parser.add_argument("run_dir", type=Path, help="a training run folder")
    parser.add_argument("out_path", nargs="?", type=Path, metavar="OUT",
                        help="output folder, or OUT.safetensors with --single-file (replaced when complete)")
    parser.add_argument("--out", type=Path, help="the output, as an option (same as OUT)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw weights, not the EMA")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder other than the newest")
    parser.add_argument("--full-pipeline", action=argparse.BooleanOptionalAction, default=None,
                        help="LoRA and textual-inversion runs: also write the whole pipeline with the adapters or "
                             "tokens merged in, under OUT/pipeline (default: the run's lora.save_merged or "
                             "textual_inversion.save_as_full_pipeline)")
    parser.add_argument("--single-file", action="store_true",
                        help="write ONE .safetensors in the family's original layout (A1111, ComfyUI, diffusers "
                             "from_single_file): the whole model where the layout holds it (Stable Diffusion, SDXL, "
                             "SD3), its tokenizers beside it in OUT.tokenizer/, OUT.tokenizer_2/...; the transformer "
                             "alone where the authors ship it so (Flux.1, Z-Image), to pair with the VAE, text "
                             "encoders and tokenizers of the pipeline folder `sdtrain export RUN OUT` writes")
    parser.add_argument("--half", action="store_true",
                        help="with --single-file: store half-precision weights, in the dtype the family was "
                             "released in (fp16; bf16 for Flux.1 and Z-Image; default fp32)")
    parser.add_argument("--text-layout", choices=["auto", "clip", "openclip"], default="auto",
                        help="with --single-file: the text encoder's layout; auto is OpenCLIP (SD 2.x) when it came "
                             "from an SD 2.x file or is 1024 wide, else CLIP (SD 1.x)")
    parser.add_argument("--card", action=argparse.BooleanOptionalAction, default=True,
                        help="write the model card beside the export: README.md with the Hugging Face Hub's "
                             "front-matter (base model, tags, instance prompt, validation grid), how to load it and "
                             "how it was trained; a single file's is README.md when the file has its folder to "
                             "itself, else OUT.md. A README.md sdtrain did not write (or one edited since) is kept, "
                             "the card going to README.sdtrain.md (OUT.sdtrain.md) instead (default: on)")
    parser.add_argument("--license", metavar="ID",
                        help="the card's license, a Hub license id (e.g. openrail++, apache-2.0; default: the base "
                             "model's, when its card is on disk, else none)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.errors import UserError
    from sdtrain.export import export_run, export_single_file

    if args.out_path and args.out and args.out_path != args.out:
        raise UserError(f"two outputs given ({args.out_path} and --out {args.out}); pass one")
    out = args.out_path or args.out
    if out is None:
        raise UserError("no output: pass OUT (a folder, or OUT.safetensors with --single-file)")
    if args.single_file:
        out = export_single_file(args.run_dir, out, ema=args.ema, checkpoint=args.checkpoint, half=args.half,
                                 text_layout=args.text_layout, card=args.card, license=args.license)
    else:
        if args.half or args.text_layout != "auto":
            raise UserError("--half and --text-layout apply to --single-file exports only")
        if out.suffix.lower() == ".safetensors":
            raise UserError(f"{out} names a file; add --single-file to write one .safetensors, or choose a folder")
        out = export_run(args.run_dir, out, ema=args.ema, checkpoint=args.checkpoint, full_pipeline=args.full_pipeline,
                         card=args.card, license=args.license)
    print(f"exported to {out}")
    return 0

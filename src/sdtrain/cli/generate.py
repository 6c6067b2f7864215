"""`sdtrain generate --model RUN_OR_PIPELINE --prompt TEXT | --prompts FILE`."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
from pathlib import Path

from sdtrain.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="images from prompts")
    parser.add_argument("--model", required=True,
                        help="a diffusers pipeline folder, a single-file .safetensors checkpoint or a diffusion run; "
                        "or a Hugging Face Hub id: org/name, org/name@REVISION, org/name/FILE.safetensors (fetched "
                        "into the Hub cache unless cached; HF_HUB_OFFLINE=1: from the cache only)")
    parser.add_argument("--tokenizer", help="with a single-file --model: its CLIP tokenizer folder (default: "
                        "NAME.tokenizer/ beside the file), or a Hub id of a pipeline or tokenizer")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    group.add_argument("--prompts", type=Path,
                       help="a file with one prompt per line, or a TSV/CSV with a caption column")
    parser.add_argument("--out", type=Path, default=Path("samples"), help="output folder")
    parser.add_argument("--steps", type=int, default=None,
                        help="sampling steps (default: a run's, or an sdtrain export's, validation steps; else the "
                        "model's own: 4 for Flux.1-schnell and a distilled Flux.2 klein, 8 for Z-Image-Turbo; "
                        "else 30)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="guidance scale (default: a run's, or an sdtrain export's, validation guidance; else the "
                        "model's own: 3.5 for Flux.1-dev's guidance embedding, off for a step-distilled model "
                        "(Flux.1-schnell, a distilled Flux.2 klein, Z-Image-Turbo), else classifier-free guidance "
                        "at the family's scale (4 for Flux.2 and Qwen-Image, 5 for the others))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first prompt; prompt i uses seed + i")
    parser.add_argument("--size", type=int, default=None,
                        help="image side in pixels (default: a run's, or an sdtrain export's, training resolution, "
                        "else the pipeline's default: Flux.1's is 1024 whatever it trained on)")
    parser.add_argument("--frames", type=int, default=None,
                        help="a video model's frames per clip (Wan: 4n+1; default: what the run's validation drew, "
                             "else the pipeline's own)")
    parser.add_argument("--scheduler", default="euler", choices=["euler", "ddim", "dpmpp"],
                        help="sampler of DDPM-schedule models; flow-matching ones (SD3, Flux.1) use their Euler")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="with a run: use the raw weights")
    parser.add_argument("--lora", action="append", default=[], metavar="PATH",
                        help="LoRA adapters to apply: an exported folder or a .safetensors file (repeatable)")
    parser.add_argument("--lora-scale", type=float, default=1.0, help="strength of the LoRA adapters")
    parser.add_argument("--embedding", action="append", default=[], metavar="FILE",
                        help="a textual-inversion learned_embeds.safetensors (or its folder) to load (repeatable)")
    parser.add_argument("--controlnet", metavar="DIR",
                        help="a ControlNet folder (OUT/controlnet of `sdtrain export` of a ControlNet run)")
    parser.add_argument("--control-image", action="append", default=[], metavar="PNG",
                        help="with --controlnet: the conditioning image each prompt follows, in turn (repeatable)")
    parser.add_argument("--control-scale", type=float, default=1.0, help="with --controlnet: its strength")
    parser.add_argument("--image", action="append", default=[], metavar="PNG",
                        help="with a model that edits (Flux.1 Kontext, InstructPix2Pix): the image each prompt, "
                             "an instruction, edits, in turn (repeatable)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.generate import generate, local_model

    if args.prompts is not None:
        from sdtrain.evaluate.run import read_prompts

        prompts = read_prompts(args.prompts)
    else:
        prompts = args.prompt
    if args.steps is not None and args.steps < 1:
        raise UserError("--steps: must be at least 1")
    if args.size is not None and (args.size < 8 or args.size % 8):
        raise UserError(f"--size: {args.size} is not a positive multiple of 8")
    if args.frames is not None and args.frames < 1:
        raise UserError("--frames: must be at least 1")
    # A Hub id is fetched (or found in the cache) once, here: generate reads the folder it becomes.
    model, tokenizer = local_model(args.model, args.tokenizer)
    paths = generate(model, prompts, args.out, steps=args.steps, guidance=args.guidance, seed=args.seed,
                     scheduler=args.scheduler, ema=args.ema, device=args.device,
                     negative_prompt=args.negative_prompt, loras=args.lora, lora_scale=args.lora_scale,
                     embeddings=args.embedding, tokenizer=tokenizer, size=args.size, controlnet=args.controlnet,
                     control_images=args.control_image, control_scale=args.control_scale, images=args.image,
                     frames=args.frames)
    clips = sum(path.suffix == ".mp4" for path in paths)
    print(f"wrote {len(paths) - 1 - clips} images, {clips} clips and {paths[-1]}" if clips
          else f"wrote {len(paths) - 1} images and {paths[-1]}")
    return 0

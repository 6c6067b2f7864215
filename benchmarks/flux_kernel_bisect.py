"""Bisect the kernel behind Flux-schnell's first-backward crash on an H100/H200 (torch 2.11+, where cuDNN is the
default SDPA backend on sm90). Each case runs in its own process with CUDA_LAUNCH_BLOCKING=1, so a sticky CUDA error
in one case cannot poison the next, and the failing kernel is the one named in the traceback.

    python benchmarks/flux_kernel_bisect.py          # all cases, about 1-2 min on an H200
    python benchmarks/flux_kernel_bisect.py --cpu    # a tiny dry run on a CPU

Cases: (1) bare SDPA forward+backward in Flux's exact layout (B=16, H=24, S=256+256, D=128, bf16, q/k/v permuted
views of B,S,H,D memory) under each SDPA backend; (2) one real-width Flux double block + one single block
(diffusers FluxTransformer2DModel, MLPerf reference init as sdtrain applies it), bf16 autocast, as sdtrain's step
calls it, under each backend."""

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

CASES = [(kind, backend) for kind in ("sdpa", "flux") for backend in ("default", "cudnn", "flash", "efficient", "math")]


def run_case(kind: str, backend: str, cpu: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device = torch.device("cpu" if cpu else "cuda")
    B, S_img, S_txt, H, D = (2, 16, 16, 2, 16) if cpu else (16, 256, 256, 24, 128)
    backends = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
                "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}
    ctx = sdpa_kernel(backends[backend]) if backend != "default" else torch.autocast(device.type, enabled=True,
                                                                                    dtype=torch.bfloat16)
    torch.manual_seed(0)
    with ctx:
        if kind == "sdpa":
            S = S_img + S_txt
            x = [torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
            q, k, v = (t.permute(0, 2, 1, 3) for t in x)  # diffusers' native backend: B,S,H,D -> B,H,S,D views
            out = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2, 3)
            out.float().square().mean().backward()
            result = float(sum(t.grad.float().abs().sum() for t in x))
        else:
            from diffusers import FluxTransformer2DModel
            sys.path.insert(0, str(SRC))
            from sdtrain.models.families.flux import image_ids, reference_init
            from sdtrain.models.families.patches import pack
            width = dict(attention_head_dim=D, num_attention_heads=H, joint_attention_dim=64 if cpu else 4096,
                         pooled_projection_dim=32 if cpu else 768, axes_dims_rope=[4, 6, 6] if cpu else [16, 56, 56])
            model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                           guidance_embeds=False, **width).to(device).train()
            reference_init(model)
            side = int(S_img ** 0.5) * 2
            lat = torch.randn(B, 16, side, side, device=device)
            ctx_emb = torch.randn(B, S_txt, width["joint_attention_dim"], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(hidden_states=pack(lat), encoder_hidden_states=ctx_emb,
                            pooled_projections=torch.randn(B, width["pooled_projection_dim"], device=device),
                            timestep=torch.rand(B, device=device),
                            img_ids=image_ids(side // 2, side // 2, device, torch.float32),
                            txt_ids=torch.zeros(S_txt, 3, device=device), return_dict=False)[0]
            target = torch.randn_like(out, dtype=torch.float32)
            F.mse_loss(out.float(), target).backward()
            result = float(sum(p.grad.float().abs().sum() for p in model.parameters() if p.grad is not None))
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"kind": kind, "backend": backend, "ok": True, "grad_abs_sum": result}))


def main() -> None:
    cpu = "--cpu" in sys.argv
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        run_case(sys.argv[2], sys.argv[3], cpu)
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    for kind, backend in CASES:
        if cpu and backend in ("cudnn", "flash", "efficient"):
            continue
        done = subprocess.run([sys.executable, __file__, "--one", kind, backend, *(["--cpu"] if cpu else [])],
                              env=env, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            print(done.stdout.strip().splitlines()[-1])
        else:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()]
            tail = (errors or lines)[-4:]
            print(json.dumps({"kind": kind, "backend": backend, "ok": False, "rc": done.returncode, "tail": tail}))


if __name__ == "__main__":
    main()

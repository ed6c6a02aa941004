"""Train the demo's two models on the tiny world (scripts/tiny_world.py), the way ComfyUI samples them.

    python scripts/train_tiny.py --out DIR [--seed 0]      (the ComfyUI tree's python; about 10 minutes)

- The VAE: a small autoencoder (64x64x3 -> 8x8x16) whose layers are a subset of the 16-channel TAESD's,
  so its file is a TAESD state dict that ComfyUI's VAELoader detects as one (`taesd_decoder.1.weight`
  with 16 input channels): the unused TAESD blocks hold zeros (a zeroed block is a ReLU there) and the
  layers are narrower than TAESD's 64 channels, zero-padded to them. `vae_scale` / `vae_shift` are
  SD3's latent scale and shift (comfy/latent_formats.py SD3: 1.5305, 0.0609), as ComfyUI's own taesd3
  gets them, so the latent the sampler works in is exactly the encoder's output, normalized per channel.
- The diffusion model: ComfyUI's own MMDiT in the demo's tiny SD3 form (scripts/tiny_models.py: hidden
  128, depth 2, context 4096, pooled 2048), trained with rectified flow as ComfyUI's SD3 sampling
  reads it (comfy/model_sampling.py ModelSamplingDiscreteFlow, shift 3: x_t = (1-s) x0 + s n, the model
  predicts n - x0 at timestep 1000 s, s drawn logit-normal and shifted by 3), conditioned on the demo's
  random CLIP-L run through ComfyUI's own SD3 text encoder path (comfy.sd.load_clip, type sd3).

What the model learns to read. Prompts are "a red circle" and "red circle"; only the rows of the words
carry the class. The rows after them (end and padding tokens) and the pooled vector come from random
other texts in most steps, so the model learns to ignore them: they hold the whole prompt, unknown
words included, and an engram memory can never rewrite them (it writes only the rows of the memorized
phrase's own tokens). A word like "lighthouse" is then one row that a memory can make read like the
second row of "blue triangle", which carries both words (CLIP is causal).

Everything is seeded. This file is the training and nothing else: scripts/tiny_world_cache.py hashes it
(with the world and the tiny models' recipe) into the cache key, and holds `ensure()`, which the demo,
the tests and the benchmark call: it unpacks the weights committed in scripts/tiny_world_weights/ when
they were made by this very code, and trains (this script, in a child process) only when they were not.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
import tiny_world as world  # noqa: E402

logger = logging.getLogger("train_tiny")

UNET = "tiny_world_sd3.safetensors"
VAE = "tiny_world_taesd3.safetensors"
CLIP_L = "tiny_clip_l.safetensors"  # the demo's random CLIP-L (scripts/tiny_models.py), not trained
REPORT = "training.json"
SD3_SCALE, SD3_SHIFT = 1.5305, 0.0609  # comfy/latent_formats.py SD3 (checked against the tree at run time)
FLOW_SHIFT = 3.0  # comfy/supported_models.py SD3 sampling_settings (checked too)
START_TOKEN, END_TOKEN = 49406, 49407  # CLIP's; SD3's CLIP-L pads with the end token
CLIP_L_WIDTH = 768  # columns of the SD3 conditioning that CLIP-L fills; the rest are zeros without CLIP-G and T5

# Words for the other texts whose end rows and pooled vectors the model learns to ignore. One CLIP token
# each; none of them is a word of the world, and "lighthouse" (the demo's unseen word) is not among them.
FILLER_NOUNS = (
    "house", "tree", "dog", "cat", "boat", "car", "river", "mountain", "city", "flower", "bird", "horse",
    "chair", "table", "window", "door", "garden", "forest", "road", "bridge", "castle", "cloud", "moon",
    "apple", "book", "lamp", "clock", "ship", "train", "shoe", "hat", "cup", "fish", "stone", "island",
)
FILLER_ADJECTIVES = ("old", "small", "big", "quiet", "dark", "bright", "tall", "soft", "happy", "strange", "wooden", "empty")


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    images_per_class: int = 256
    ae_steps: int = 1000
    ae_batch: int = 32
    ae_lr: float = 3e-3
    latent_noise: float = 0.1
    unet_steps: int = 2000
    unet_batch: int = 64
    unet_lr: float = 1.5e-3
    drop_cond: float = 0.1  # share of steps on the empty prompt, for classifier-free guidance
    own_tail: float = 0.3  # share of steps that keep the prompt's own end rows (and, apart, pooled vector)
    fillers: int = 24  # other texts per word count
    eval_seeds: int = 2
    eval_steps: int = 12
    eval_cfg: float = 4.0


# ----- the models' pieces -----

def sincos_pos_embed(mmdit, hidden: int, grid: int):
    import torch

    return torch.from_numpy(mmdit.get_2d_sincos_pos_embed(hidden, grid)).float().unsqueeze(0)


def build_unet(mmdit, torch, tiny_models):
    """ComfyUI's MMDiT in the tiny SD3 form, initialized as DiT does (adaLN-zero: every block starts as
    the identity, the output as zero; sin-cos position table; norms 1)."""
    model = mmdit.MMDiT(
        patch_size=2, in_channels=16, out_channels=16, depth=tiny_models.HIDDEN // 64,
        adm_in_channels=tiny_models.POOLED,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": tiny_models.CONTEXT, "out_features": tiny_models.HIDDEN}},
        pos_embed_max_size=tiny_models.POS_EMBED_MAX, num_patches=tiny_models.POS_EMBED_MAX ** 2,
        qk_norm="rms", dtype=torch.float32, operations=torch.nn,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif param.dim() >= 2:
                torch.nn.init.xavier_uniform_(param.view(param.shape[0], -1)) if "x_embedder" in name else param.normal_(0.0, 0.02)
            else:
                param.zero_()
        for module in model.modules():
            if hasattr(module, "adaLN_modulation"):
                module.adaLN_modulation[-1].weight.zero_()
                module.adaLN_modulation[-1].bias.zero_()
        model.final_layer.linear.weight.zero_()
        model.final_layer.linear.bias.zero_()
        model.pos_embed.copy_(sincos_pos_embed(mmdit, tiny_models.HIDDEN, tiny_models.POS_EMBED_MAX))
    return model


def make_autoencoder(torch):
    """A narrow TAESD: the same layer sequence (taesd.Encoder / taesd.Decoder indices), fewer channels,
    and only some blocks trained (None: a zeroed block, i.e. a ReLU). Returns (encoder, decoder, plan)."""
    nn = torch.nn

    class Block(nn.Module):  # taesd.Block with n_in == n_out: ReLU(conv(x) + x)
        def __init__(self, n):
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(), nn.Conv2d(n, n, 3, padding=1), nn.ReLU(), nn.Conv2d(n, n, 3, padding=1))

        def forward(self, x):
            return torch.relu(self.conv(x) + x)

    class Clamp(nn.Module):
        def forward(self, x):
            return torch.tanh(x / 3) * 3

    relu = nn.ReLU
    # index in TAESD's Sequential -> module; widths: encoder 8/16/32/32, decoder 32/16/8/8 (the pictures are
    # flat colours: the work that matters is at 8x8, where one block runs in each direction)
    encoder = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), relu(),                       # 0, 1
        nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False), relu(), nn.Identity(), nn.Identity(),   # 2-5
        nn.Conv2d(16, 32, 3, padding=1, stride=2, bias=False), relu(), nn.Identity(), nn.Identity(),  # 6-9
        nn.Conv2d(32, 32, 3, padding=1, stride=2, bias=False), relu(), Block(32), nn.Identity(),      # 10-13
        nn.Conv2d(32, 16, 3, padding=1),                             # 14
    )
    decoder = nn.Sequential(
        Clamp(), nn.Conv2d(16, 32, 3, padding=1), relu(),            # 0-2
        Block(32), nn.Identity(), nn.Identity(),                     # 3-5
        nn.Upsample(scale_factor=2), nn.Conv2d(32, 16, 3, padding=1, bias=False), relu(), nn.Identity(), nn.Identity(),  # 6-10
        nn.Upsample(scale_factor=2), nn.Conv2d(16, 8, 3, padding=1, bias=False), relu(), nn.Identity(), nn.Identity(),   # 11-15
        nn.Upsample(scale_factor=2), nn.Conv2d(8, 8, 3, padding=1, bias=False), relu(),            # 16-18
        nn.Conv2d(8, 3, 3, padding=1),                               # 19
    )
    return encoder, decoder


def taesd_state_dict(encoder, decoder, taesd, torch) -> dict:
    """The narrow autoencoder as a 16-channel TAESD state dict: each conv zero-padded to TAESD's shape,
    blocks that were not trained zeroed (ReLU(0 + x) = x after a ReLU, and a ReLU after a conv)."""
    full = taesd.TAESD(latent_channels=16)
    sd = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in full.state_dict().items()}
    for prefix, seq in (("taesd_encoder", encoder), ("taesd_decoder", decoder)):
        for name, value in seq.state_dict().items():
            key = f"{prefix}.{name}"
            if key not in sd:
                raise KeyError(f"{key} has no place in TAESD")
            target = sd[key]
            index = tuple(slice(0, n) for n in value.shape)
            if value.dim() != target.dim() or any(n > m for n, m in zip(value.shape, target.shape)):
                raise ValueError(f"{key}: {tuple(value.shape)} does not fit TAESD's {tuple(target.shape)}")
            target[index] = value.float()
    sd["vae_scale"] = torch.tensor(SD3_SCALE)
    sd["vae_shift"] = torch.tensor(SD3_SHIFT)
    return sd


# ----- text -----

def filler_texts(words: int, count: int, rng) -> list[str]:
    out = []
    while len(out) < count:
        noun = FILLER_NOUNS[rng.integers(len(FILLER_NOUNS))]
        adj = FILLER_ADJECTIVES[rng.integers(len(FILLER_ADJECTIVES))]
        text = {2: [f"a {noun}", f"{adj} {noun}"], 3: [f"a {adj} {noun}"]}[words][rng.integers(2 if words == 2 else 1)]
        if text not in out:
            out.append(text)
    return out


def encode_texts(clip, texts: list[str], torch):
    """{text: (rows [77, 768] float32, pooled [768] float32, live tokens)} through ComfyUI's SD3 path."""
    out = {}
    for text in texts:
        tokens = clip.tokenize(text)
        cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
        cond, pooled = cond[0].float(), pooled[0].float()
        if cond.shape != (77, 4096) or cond[:, CLIP_L_WIDTH:].abs().max() != 0 or pooled[CLIP_L_WIDTH:].abs().max() != 0:
            raise RuntimeError(f"unexpected SD3 conditioning for {text!r}: {tuple(cond.shape)}; CLIP-L alone should fill 768 columns")
        live = sum(1 for token, _ in tokens["l"][0] if token not in (START_TOKEN, END_TOKEN))
        out[text] = (cond[:, :CLIP_L_WIDTH].clone(), pooled[:CLIP_L_WIDTH].clone(), live)
    return out


# ----- training -----

def threads() -> int:
    """Torch threads: one, unless TINY_WORLD_THREADS says otherwise. The thread count changes float
    rounding, and this short training is sensitive to it: with two threads the same seed gave an
    autoencoder that drew red as yellow (judge 75% on held-out pictures), with one thread 100%. One
    thread is also faster where others load the cores (threads waiting on each other)."""
    return max(1, int(os.environ.get("TINY_WORLD_THREADS", "1")))


def train(recipe: Recipe, out: Path) -> dict:
    import numpy as np
    import torch

    import tiny_models

    started = time.monotonic()
    tree = tiny_models.comfyui_path(None)
    comfy, mmdit, taesd = tiny_models.import_comfy(tree)
    import comfy.latent_formats
    import comfy.sd
    import comfy.supported_models

    fmt = comfy.latent_formats.SD3()
    if (round(fmt.scale_factor, 4), round(fmt.shift_factor, 4)) != (SD3_SCALE, SD3_SHIFT):
        raise RuntimeError(f"this ComfyUI's SD3 latent format is scale {fmt.scale_factor}, shift {fmt.shift_factor}; the VAE assumes {SD3_SCALE}, {SD3_SHIFT}")
    if comfy.supported_models.SD3.sampling_settings.get("shift") != FLOW_SHIFT:
        raise RuntimeError(f"this ComfyUI samples SD3 with shift {comfy.supported_models.SD3.sampling_settings}, training assumes {FLOW_SHIFT}")

    torch.set_num_threads(threads())
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    out.mkdir(parents=True, exist_ok=True)

    # the demo's CLIP-L (same recipe as scripts/tiny_models.py) and every text's conditioning
    clip_path = out / CLIP_L
    tiny_models.save(tiny_models.make_clip_l(comfy, torch), clip_path)
    clip = comfy.sd.load_clip(ckpt_paths=[str(clip_path)], clip_type=comfy.sd.CLIPType.SD3)
    phrasings = {k: (world.prompt(c, s), f"{c} {s}") for k, (c, s) in enumerate(world.CLASSES)}
    fillers = {n: filler_texts(n, recipe.fillers, rng) for n in (2, 3)}
    texts = [t for pair in phrasings.values() for t in pair] + [t for ts in fillers.values() for t in ts] + [""]
    if any("lighthouse" in t for t in texts):
        raise RuntimeError("the demo's unseen word got into the training texts")
    t0 = time.monotonic()
    enc = encode_texts(clip, texts, torch)
    logger.info("torch threads: %d", torch.get_num_threads())
    logger.info("encoded %d texts with the CLIP-L in %.1f s", len(texts), time.monotonic() - t0)
    del clip

    # pictures of the world
    images, labels = world.dataset(recipe.images_per_class, recipe.seed)
    x_all = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255.0)
    y_all = torch.from_numpy(labels)

    # ----- the autoencoder -----
    t0 = time.monotonic()
    encoder, decoder = make_autoencoder(torch)
    params = list(encoder.parameters()) + list(decoder.parameters())
    opt = torch.optim.AdamW(params, lr=recipe.ae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.ae_lr, total_steps=recipe.ae_steps, pct_start=0.1)
    ae_losses = []
    for step in range(recipe.ae_steps):
        idx = torch.randint(0, x_all.shape[0], (recipe.ae_batch,))
        x = x_all[idx]
        z = encoder(x)
        zn = (z - z.mean(dim=(0, 2, 3), keepdim=True)) / (z.std(dim=(0, 2, 3), keepdim=True) + 1e-5)
        rec = decoder(zn + recipe.latent_noise * torch.randn_like(zn))
        loss = torch.nn.functional.mse_loss(rec, x) + 0.1 * (rec - x).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ae_losses.append(float(loss.detach()))
        if step % 100 == 0 or step == recipe.ae_steps - 1:
            logger.info("autoencoder step %d/%d loss %.5f", step + 1, recipe.ae_steps, loss)
    encoder.eval()
    decoder.eval()
    with torch.no_grad():
        z = torch.cat([encoder(x_all[i:i + 256]) for i in range(0, x_all.shape[0], 256)])
        mean, std = z.mean(dim=(0, 2, 3)), z.std(dim=(0, 2, 3))
        last = encoder[14]  # fold the per-channel normalization into the encoder's last conv
        last.weight.div_(std.view(-1, 1, 1, 1))
        last.bias.sub_(mean).div_(std)
        latents = torch.cat([encoder(x_all[i:i + 256]) for i in range(0, x_all.shape[0], 256)])
        recon = torch.cat([decoder(latents[i:i + 256]) for i in range(0, latents.shape[0], 256)]).clamp(0, 1)
        ae_mse = float(torch.nn.functional.mse_loss(recon, x_all))
        ae_psnr = 10 * math.log10(1.0 / max(ae_mse, 1e-12))
        # the judge on reconstructions of pictures it never trained on
        held_out, held_labels = world.dataset(8, recipe.seed + 1000)
        x_held = torch.from_numpy(held_out).permute(0, 3, 1, 2).float().div(255.0)
        rec_held = decoder(encoder(x_held)).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        ae_judge = sum(world.judge(img).reads(*world.CLASSES[k]) for img, k in zip(rec_held, held_labels)) / len(held_labels)
    ae_seconds = time.monotonic() - t0
    logger.info("autoencoder: %.1f s, reconstruction PSNR %.1f dB, judge reads %.1f%% of held-out reconstructions, latent std %.3f",
                ae_seconds, ae_psnr, 100 * ae_judge, float(latents.std()))

    # ----- the diffusion model -----
    t0 = time.monotonic()
    unet = build_unet(mmdit, torch, tiny_models)
    # CLIP-L fills only the first 768 of the 4096 context columns, so the context embedder is trained on
    # those (the same products, a fifth of the work) and saved zero-padded.
    full_ce = unet.context_embedder
    unet.context_embedder = torch.nn.Linear(CLIP_L_WIDTH, full_ce.out_features)
    with torch.no_grad():
        unet.context_embedder.weight.copy_(full_ce.weight[:, :CLIP_L_WIDTH])
        unet.context_embedder.bias.copy_(full_ce.bias)
    unet.train()

    def stack(texts_):
        rows = torch.stack([enc[t][0] for t in texts_])
        pooled = torch.stack([enc[t][1] for t in texts_])
        return rows, pooled

    class_rows = {p: stack([phrasings[k][p] for k in range(len(world.CLASSES))]) for p in (0, 1)}  # article, bare
    filler_rows = {n: stack(fillers[n]) for n in (2, 3)}
    empty_rows, empty_pooled = enc[""][0], enc[""][1]
    a_row = enc[phrasings[0][0]][0][1]  # "a" after the start token: the same row in every "a ..." prompt
    pooled_pad = torch.zeros(tiny_models.POOLED - CLIP_L_WIDTH)

    row_index = torch.arange(77)

    def conditioning(classes: torch.Tensor):
        b = classes.shape[0]
        bare = torch.rand(b) < 0.5
        rows = torch.where(bare.view(-1, 1, 1), class_rows[1][0][classes], class_rows[0][0][classes])
        pooled = torch.where(bare.view(-1, 1), class_rows[1][1][classes], class_rows[0][1][classes])
        # "a" where the colour was in "red circle": what "a <memorized word>" looks like
        swap = bare & (torch.rand(b) < 0.5)
        rows = torch.where((swap.view(-1, 1) & (row_index == 1)).unsqueeze(-1), a_row, rows)
        # another text's end rows (after the prompt's own words) and, apart, its pooled vector
        f2 = torch.randint(0, filler_rows[2][0].shape[0], (b,))
        f3 = torch.randint(0, filler_rows[3][0].shape[0], (b,))
        f_rows = torch.where(bare.view(-1, 1, 1), filler_rows[2][0][f2], filler_rows[3][0][f3])
        first_end_row = torch.where(bare, 3, 4).view(-1, 1)
        tail = (row_index >= first_end_row) & (torch.rand(b, 1) >= recipe.own_tail)
        rows = torch.where(tail.unsqueeze(-1), f_rows, rows)
        g2 = torch.randint(0, filler_rows[2][1].shape[0], (b,))
        g3 = torch.randint(0, filler_rows[3][1].shape[0], (b,))
        f_pooled = torch.where(bare.view(-1, 1), filler_rows[2][1][g2], filler_rows[3][1][g3])
        pooled = torch.where((torch.rand(b) >= recipe.own_tail).view(-1, 1), f_pooled, pooled)
        drop = (torch.rand(b) < recipe.drop_cond).view(-1, 1)
        rows = torch.where(drop.unsqueeze(-1), empty_rows, rows)
        pooled = torch.where(drop, empty_pooled, pooled)
        return rows, torch.cat([pooled, pooled_pad.expand(b, -1)], dim=1)

    opt = torch.optim.AdamW(unet.parameters(), lr=recipe.unet_lr, weight_decay=0.0, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.unet_lr, total_steps=recipe.unet_steps, pct_start=0.05)
    unet_losses = []
    live = [p for p in unet.parameters()]
    ema = [p.detach().clone() for p in live]
    for step in range(recipe.unet_steps):
        idx = torch.randint(0, latents.shape[0], (recipe.unet_batch,))
        x0 = latents[idx]
        context, pooled = conditioning(y_all[idx])
        noise = torch.randn_like(x0)
        u = torch.sigmoid(torch.randn(x0.shape[0]))  # logit-normal, then ComfyUI's shift
        sigma = FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = unet(xt, sigma * 1000.0, y=pooled, context=context)
        loss = torch.nn.functional.mse_loss(v.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        sched.step()
        unet_losses.append(float(loss.detach()))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in live], 1 - min(0.995, (1 + step) / (10 + step)))
        if step % 100 == 0 or step == recipe.unet_steps - 1:
            logger.info("diffusion step %d/%d loss %.4f (mean of last 100: %.4f)", step + 1, recipe.unet_steps, loss,
                        sum(unet_losses[-100:]) / len(unet_losses[-100:]))
    with torch.no_grad():
        for p, e in zip(live, ema):
            p.copy_(e)
    unet.eval()
    unet_seconds = time.monotonic() - t0

    # ----- a quick check in this process (the demo, tests and bench/quality.py check through ComfyUI) -----
    acc = evaluate(unet, decoder, enc, phrasings, recipe, torch, pooled_pad)
    logger.info("in-process check: colour %.2f, shape %.2f over %d samples", acc["colour"], acc["shape"], acc["samples"])

    # ----- files -----
    sd = {k: v.detach().float() for k, v in unet.state_dict().items()}
    weight = torch.zeros(full_ce.out_features, full_ce.in_features)
    weight[:, :CLIP_L_WIDTH] = sd.pop("context_embedder.weight")
    sd["context_embedder.weight"] = weight
    tiny_models.save({k: v.to(torch.bfloat16) for k, v in sd.items()}, out / UNET)
    tiny_models.save(taesd_state_dict(encoder, decoder, taesd, torch), out / VAE)
    tail = unet_losses[-100:]
    report = {
        "seed": recipe.seed,
        "recipe": asdict(recipe),
        "seconds": round(time.monotonic() - started, 1),
        "autoencoder_seconds": round(ae_seconds, 1),
        "autoencoder_psnr_db": round(ae_psnr, 2),
        "autoencoder_judge": round(ae_judge, 3),
        "diffusion_seconds": round(unet_seconds, 1),
        "diffusion_final_loss": round(sum(tail) / len(tail), 4),
        "diffusion_first_loss": round(sum(unet_losses[:20]) / 20, 4),
        "in_process_check": acc,
        "torch": torch.__version__,
    }
    (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")  # last: its presence marks the cache complete
    return report


def evaluate(unet, decoder, enc, phrasings, recipe: Recipe, torch, pooled_pad) -> dict:
    """Euler over ComfyUI's 'simple' schedule of the shift-3 flow sigmas, cfg on the empty prompt."""
    t = torch.arange(1, 1001, dtype=torch.float64) / 1000
    table = FLOW_SHIFT * t / (1 + (FLOW_SHIFT - 1) * t)
    ss = len(table) / recipe.eval_steps
    sigmas = [float(table[-(1 + int(i * ss))]) for i in range(recipe.eval_steps)] + [0.0]
    colour = shape = n = 0
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for k, (c, s) in enumerate(world.CLASSES):
            text = phrasings[k][0]
            cond = torch.stack([enc[text][0], enc[""][0]])
            pooled = torch.cat([torch.stack([enc[text][1], enc[""][1]]), pooled_pad.expand(2, -1)], dim=1)
            for _ in range(recipe.eval_seeds):
                x = torch.randn(1, 16, 8, 8, generator=g)
                for a, b in zip(sigmas[:-1], sigmas[1:]):
                    v = unet(x.expand(2, -1, -1, -1), torch.full((2,), a * 1000.0), y=pooled, context=cond)
                    v = v[1:] + recipe.eval_cfg * (v[:1] - v[1:])
                    x = x + v * (b - a)
                img = decoder(x).clamp(0, 1)[0].permute(1, 2, 0).numpy()
                verdict = world.judge(img)
                colour += verdict.colour == c
                shape += verdict.shape == s
                n += 1
    return {"colour": round(colour / n, 3), "shape": round(shape / n, 3), "samples": n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="write the files here (tiny_world_cache.py --train trains into the cache)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a field of the recipe (experiments)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[train_tiny] %(message)s")
    fields = {f: type(v) for f, v in asdict(Recipe()).items()}
    changes = {k: fields[k](v) for k, v in (item.split("=", 1) for item in args.set)}
    report = train(Recipe(seed=args.seed, **changes), args.out)
    logger.info("%s", json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

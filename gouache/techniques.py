"""The techniques a forward can combine, and the compatibility table: for every pair, whether
it composes exactly, composes approximately, or is refused (docs/architecture.md, "The
compatibility table").

A technique is asked for by a request field (`loras`, `controlnets`, ...) or chosen by the
server (`--lora-bound`, the policy's layout and degree). Every rule of which techniques go
together is read from here: admission refuses a request whose fields ask for a refused pair,
naming both fields (`refused_pair`); a server default applies to a request only where it
composes with what the request uses (`applies`); a server whose every step runs on several
devices does not serve what such a step does without (`unserved`), and refuses the flags that
would turn it on at start (`refused_flag`); the forward composer (`gouache.runner.forward`)
checks each row of a step (`check_row`). The tables in docs/architecture.md are rendered from
here (`markdown`). No torch here: the API reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations


@dataclass(frozen=True)
class Technique:
    name: str
    field: str  # what asks for it: a request field, or the server flag or policy that chooses it
    exact: bool  # whether it keeps a request's image equal to diffusers' (docs/architecture.md, invariant 2)
    per_request: bool  # a request asks for it; else the server or its policy chooses it per step
    what: str
    # a step that uses it may run its denoiser compiled under --compile (`gouache.runner.compiled`);
    # else the step runs eagerly, counted: its hooks, wrapped blocks or split shapes are not in the graph
    compiles: bool = False
    compiled: str = ""  # how it is in the graph, or why not (docs/architecture.md's "compiled" column)
    flags: tuple[str, ...] = ()  # server flags that turn it on for requests that do not ask
    # what a step on several devices does in its place ("": it runs there): a server whose every
    # step runs on several devices does not serve it (`unserved`)
    several_devices: str = ""


TECHNIQUES = {t.name: t for t in (
    Technique("lora", "loras", True, True, "LoRA adapters on the denoiser (KATZ): merged, segmented per row or split",
              compiles=True, compiled="yes (merged: weights as inputs; segmented: per-row pairs in slots the graph "
                                      "reads, a packed forward's per token by its layout)"),
    Technique("lora_async", "--lora-bound", False, False,
              "bounded asynchronous LoRA loading (KATZ): a request denoises without its adapters until they arrive",
              compiles=True, compiled="yes, as `lora`", flags=("--lora-bound",),
              several_devices="ranks load adapters before the step (synchronously)"),
    Technique("controlnet", "controlnets", True, True,
              "ControlNet residuals (KATZ), in process or from the service overlapping the UNet's encoder",
              compiles=True, compiled="yes (the residuals are inputs of the UNet's graph; in-process ControlNets run "
                                      "in a graph of their own; the service's sync residuals are waited for before "
                                      "the UNet, not during its encoder)"),
    Technique("controlnet_async", "controlnet_mode", False, True,
              "asynchronous ControlNet residuals (KATZ): step t takes the residuals of step t - 1",
              compiles=True, compiled="yes, as `controlnet`"),
    Technique("template", "template_cache", False, True,
              "template replay of an edit's unmasked tokens (InstGenIE)",
              compiled="UNets: yes, one graph a size and row bucket, the layout as data (under CUDA graphs: not "
                       "yet); SD3 and FLUX.1 (Kontext too): yes, in compiled pieces per row and computed-token "
                       "bucket (`--compile-sizes` sets them), the templates' keys and values filled between pieces; "
                       "a recorder's steps and a load plan's run eagerly; other DiTs: no, the step runs eagerly",
              flags=("--template-cache", "--template-cost-model"), several_devices="template reuse does not apply"),
    Technique("block_cache", "block_cache", False, True,
              "block-output reuse across steps (PatchedServe), per image, patch or token; decided by a "
              "threshold or by the reuse predictor (--block-cache-predictor)",
              compiled="UNets on a GPU, per image: yes, each block a compiled piece on the rows it computes, the "
                       "reuse decisions between pieces (untested there; on a CPU the pieces lost to eager blocks); "
                       "elsewhere: no, the step runs eagerly",
              flags=("--block-cache", "--block-cache-predictor"), several_devices="the block cache does not apply"),
    Technique("mixed_sizes", "--policy", True, False,
              "mixed sizes in one forward: a patched UNet (PatchedServe) or packed DiT tokens",
              compiled="UNets: yes, one graph a patch side, the layout as data (under CUDA graphs one a padded "
                       "patch and image bucket); SD3 and "
                       "FLUX.1: yes, in compiled pieces per row and token bucket, attention between them "
                       "(`gouache.runner.pieces`); FLUX.2 and Qwen-Image run one forward per size, each its "
                       "row graph"),
    Technique("parallel", "--devices", True, False,
              "a step on several devices: Ulysses sequence parallelism (DiTs) or CFG halves (UNets)",
              compiled="UNets (CFG halves): yes, each rank's rows through the row graph of their count, the halves "
                       "gathered outside it; SD3 and FLUX.1 (Ulysses): yes, each rank's shard of every row through "
                       "the family's compiled pieces at its row bucket, the all-to-alls and attention between them, "
                       "the output gathered after the last; other DiTs: no, the step runs eagerly"),
    Technique("reference", "image", True, True,
              "an edit's reference tokens (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit): the uploads' latents after the "
              "image's own, asked by any edit on an instruction-edit model",
              compiles=True,
              compiled="yes, a row graph per image size and reference layout (the warm-up compiles an edit of "
                       "each size with one reference of its size, a background child any other layout when first "
                       "met); FLUX.1 Kontext's in the packed pieces too"),
    Technique("img2img", "strength", True, True,
              "img2img: an edit without a mask starts from its upload noised to `strength` of its schedule and runs "
              "the steps after", compiles=True, compiled="yes, as the plain step"),
    Technique("clip", "/v1/videos", True, True,
              "a video model's clip (Wan): frames x height x width tokens, each clip's own 3D RoPE; on an "
              "image-to-video model its first frame (`input_reference`) enters as its conditioning, as its text "
              "does, and composes as the clip does",
              compiles=True, compiled="plain steps: yes, a row graph per clip shape (its frames too) and row bucket "
                                      "(`--compile-sizes WxHxF`); a packed forward of clips runs eagerly, counted as "
                                      "`mixed_sizes`"),
    Technique("conditioning", "--conditioning-mb", True, False,
              "the conditioning cache: a repeated prompt's text-encoder outputs and a repeated upload's VAE "
              "distribution, reused at preparation", compiles=True, compiled="yes (before the denoiser)"),
)}

EXACT, APPROXIMATE, REFUSED = "exact", "approximate", "refused"


@dataclass(frozen=True)
class Pair:
    verdict: str  # exact | approximate | refused
    why: str


def _pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


# One entry per pair. "exact": a request using both is served as each alone would be, and an
# exact request's image is the same with either beside it; "approximate": the pair runs, the
# image depends on the approximate technique as measured by its benchmark; "refused": never for
# one request (admission answers 400; a server default does not apply where it would make one).
# Requests of a refused pair's two techniques still share forwards: the pair is per request.
TABLE: dict[frozenset[str], Pair] = {
    _pair("lora", "lora_async"): Pair(APPROXIMATE, "adapters join their request after up to --lora-bound steps"),
    _pair("lora", "controlnet"): Pair(EXACT, "the adapters change the denoiser, the residuals come from the "
                                             "ControlNet's own weights"),
    _pair("lora", "controlnet_async"): Pair(APPROXIMATE, "the adapters are exact, the residuals a step late"),
    _pair("lora", "block_cache"): Pair(APPROXIMATE, "a forward of several adapter sets with cached rows runs one "
                                                    "forward per set (cached rows cannot be segmented)"),
    _pair("lora", "template"): Pair(APPROXIMATE, "a template is keyed by its adapters' digests; its edits load them "
                                                 "before their first step"),
    _pair("lora", "mixed_sizes"): Pair(EXACT, "patches of mixed sizes cannot be told apart by row: one forward per "
                                              "adapter set; packed tokens are segmented per row"),
    _pair("lora", "parallel"): Pair(EXACT, "every rank waits for the adapters; each CFG half applies its own rows' "
                                           "adapters"),
    _pair("lora_async", "controlnet"): Pair(APPROXIMATE, "the adapters join late, the residuals are exact"),
    _pair("lora_async", "controlnet_async"): Pair(APPROXIMATE, "both approximations apply; their fidelity is "
                                                                    "measured apart"),
    _pair("lora_async", "block_cache"): Pair(APPROXIMATE, "both approximations apply; their fidelity is measured "
                                                               "apart"),
    _pair("lora_async", "template"): Pair(APPROXIMATE, "a template's edits load their adapters before their first step "
                                                       "(the template is keyed by them)"),
    _pair("lora_async", "mixed_sizes"): Pair(APPROXIMATE, "the adapters join late, the layout is exact"),
    _pair("lora_async", "parallel"): Pair(APPROXIMATE, "a step on several devices waits for the adapters (ranks "
                                                       "must not decide apart); a server whose every step is "
                                                       "parallel refuses --lora-bound"),
    _pair("controlnet", "controlnet_async"): Pair(APPROXIMATE, "a request's ControlNets all run in its one mode"),
    _pair("controlnet", "block_cache"): Pair(REFUSED, "a ControlNet's residuals enter every block, which a reused "
                                                      "block output would drop"),
    _pair("controlnet", "template"): Pair(REFUSED, "a template's activations hold no ControlNet's residuals"),
    _pair("controlnet", "mixed_sizes"): Pair(EXACT, "requests with ControlNets run one plain forward per latent shape "
                                                    "(residuals are per image grid)"),
    _pair("controlnet", "parallel"): Pair(EXACT, "under CFG halves the residuals are computed before the rows are cut"),
    _pair("controlnet_async", "block_cache"): Pair(REFUSED, "a ControlNet's residuals enter every block, which a "
                                                            "reused block output would drop"),
    _pair("controlnet_async", "template"): Pair(REFUSED, "a template's activations hold no ControlNet's residuals"),
    _pair("controlnet_async", "mixed_sizes"): Pair(APPROXIMATE, "a plain forward per latent shape, residuals a step "
                                                                     "late"),
    _pair("controlnet_async", "parallel"): Pair(APPROXIMATE, "residuals computed before the rows are cut, a step late"),
    _pair("block_cache", "template"): Pair(REFUSED, "an edit that replays its template computes its masked tokens "
                                                    "only; it has no block outputs of its own to reuse"),
    _pair("block_cache", "mixed_sizes"): Pair(APPROXIMATE, "reuse per patch (UNet) or per token (DiT)"),
    _pair("block_cache", "parallel"): Pair(APPROXIMATE, "a step on several devices computes every block (ranks "
                                                        "must not decide apart); a server whose every step is "
                                                        "parallel refuses block_cache"),
    _pair("template", "mixed_sizes"): Pair(APPROXIMATE, "packed DiT forwards replay any mix of sizes; a UNet replays "
                                                        "one pass per latent shape"),
    _pair("template", "parallel"): Pair(APPROXIMATE, "a step on several devices computes the full forward; a server "
                                                     "whose every step is parallel refuses template reuse"),
    _pair("lora", "conditioning"): Pair(EXACT, "text-encoder layers (SD, SDXL) apply while the request's prompt is "
                                                 "encoded, and the cache keys each encoding by them"),
    _pair("lora_async", "conditioning"): Pair(APPROXIMATE, "the denoiser's layers join late; text-encoder layers are "
                                                           "read before the prompt is encoded, the encodings exact"),
    _pair("controlnet", "conditioning"): Pair(EXACT, "the residuals take the request's own prompt encoding, the "
                                                     "encoder's output bit for bit"),
    _pair("controlnet_async", "conditioning"): Pair(APPROXIMATE, "residuals a step late, the encodings are exact"),
    _pair("template", "conditioning"): Pair(APPROXIMATE, "a template's key holds its text's digest, the same from "
                                                         "the cache; its upload's distribution is sampled with the "
                                                         "request's own seed"),
    _pair("block_cache", "conditioning"): Pair(APPROXIMATE, "the block cache's reuse as measured alone, the "
                                                            "encodings are exact"),
    _pair("mixed_sizes", "conditioning"): Pair(EXACT, "preparation is per request, before any layout"),
    _pair("parallel", "conditioning"): Pair(EXACT, "the driver prepares; every rank gets the same state"),
    _pair("mixed_sizes", "parallel"): Pair(REFUSED, "a mixed-size forward runs on one device: the policies plan mixed "
                                                    "sizes at degree 1 only"),
    _pair("reference", "lora"): Pair(EXACT, "the adapters apply to the reference tokens too, as in diffusers; a step "
                                            "that splits its forwards applies each set per forward"),
    _pair("reference", "lora_async"): Pair(APPROXIMATE, "the adapters join late, the reference is exact"),
    _pair("reference", "controlnet"): Pair(REFUSED, "ControlNets serve UNets; instruction edits are DiTs' (FLUX.1 "
                                                    "Kontext, FLUX.2, Qwen-Image-Edit)"),
    _pair("reference", "controlnet_async"): Pair(REFUSED, "ControlNets serve UNets; instruction edits are DiTs' "
                                                          "(FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit)"),
    _pair("reference", "template"): Pair(APPROXIMATE, "FLUX.1 Kontext: the packed forward carries each reference, "
                                                      "whose tokens replay from the template as its unmasked ones do "
                                                      "(the template is the edit's original, its reference)"),
    _pair("reference", "block_cache"): Pair(APPROXIMATE, "FLUX.1 Kontext: reuse per image in a forward per size and "
                                                         "reference, per token (the reference's too) in the packed "
                                                         "forward"),
    _pair("reference", "mixed_sizes"): Pair(EXACT, "FLUX.1 Kontext: one packed forward, each reference after its "
                                                   "image's tokens; FLUX.2 and Qwen-Image-Edit: one forward per size "
                                                   "and reference layout"),
    _pair("reference", "parallel"): Pair(REFUSED, "Ulysses shards are not tested with reference tokens: a server whose "
                                                  "policy may plan steps on several devices refuses instruction edits"),
    _pair("reference", "conditioning"): Pair(EXACT, "the upload's latents are the VAE's mode, cached by its pixels"),
    _pair("img2img", "lora"): Pair(EXACT, "the adapters change the denoiser, img2img the starting latents and steps"),
    _pair("img2img", "lora_async"): Pair(APPROXIMATE, "the adapters join late, the starting latents are exact"),
    _pair("img2img", "controlnet"): Pair(EXACT, "the residuals take the request's own timesteps"),
    _pair("img2img", "controlnet_async"): Pair(APPROXIMATE, "the residuals a step late, the starting latents exact"),
    _pair("img2img", "template"): Pair(REFUSED, "a template replays the tokens a mask keeps; img2img keeps none"),
    _pair("img2img", "block_cache"): Pair(APPROXIMATE, "the block cache's reuse as measured alone, from the request's "
                                                       "own first step"),
    _pair("img2img", "mixed_sizes"): Pair(EXACT, "a request runs only its own steps: any mix of sizes and strengths "
                                                 "shares a forward"),
    _pair("img2img", "parallel"): Pair(EXACT, "the driver prepares the starting latents; every rank gets the same "
                                              "state"),
    _pair("img2img", "reference"): Pair(REFUSED, "an instruction-edit model's edit without a mask follows its prompt "
                                                 "and takes no strength"),
    _pair("img2img", "conditioning"): Pair(EXACT, "the upload's VAE distribution is cached by its pixels and sampled "
                                                  "with the request's own generator"),
    _pair("clip", "lora"): Pair(EXACT, "the adapters change the denoiser for every frame's tokens; a packed forward "
                                       "segments them per clip row and token"),
    _pair("clip", "lora_async"): Pair(APPROXIMATE, "the adapters join late, for every frame alike"),
    _pair("clip", "controlnet"): Pair(REFUSED, "ControlNets serve UNets; the video families are DiTs"),
    _pair("clip", "controlnet_async"): Pair(REFUSED, "ControlNets serve UNets; the video families are DiTs"),
    _pair("clip", "template"): Pair(REFUSED, "a template replays an image edit's unmasked tokens; a clip has no "
                                             "mask"),
    _pair("clip", "block_cache"): Pair(APPROXIMATE, "reuse per clip (a forward per clip shape) or per token (a "
                                                    "packed forward), measured by a per-frame SSIM"),
    _pair("clip", "mixed_sizes"): Pair(EXACT, "clips of different lengths and sizes in one packed forward, each "
                                              "with its own 3D RoPE, time embedding and text"),
    _pair("clip", "parallel"): Pair(EXACT, "Ulysses over a clip's tokens: self-attention through the all-to-alls, "
                                           "cross-attention on each rank's shard"),
    _pair("clip", "reference"): Pair(REFUSED, "a clip takes no edit's reference tokens; an image-to-video model's "
                                              "first frame is its `input_reference`"),
    _pair("clip", "img2img"): Pair(REFUSED, "a clip is not denoised from a noised upload; an image-to-video model's "
                                            "first frame conditions it from the first step"),
    _pair("clip", "conditioning"): Pair(EXACT, "a clip's prompt encodings are cached as an image's"),
}


def pair(a: str, b: str) -> Pair:
    return TABLE[_pair(a, b)]


def composes(a: str, b: str) -> bool:
    return a == b or pair(a, b).verdict != REFUSED


def refused_pair(used: set[str] | frozenset[str]) -> tuple[str, str, str] | None:
    """The first refused pair among `used` (in the table's order of techniques): (a, b, why)."""
    order = [name for name in TECHNIQUES if name in used]
    for a, b in combinations(order, 2):
        entry = pair(a, b)
        if entry.verdict == REFUSED:
            return a, b, entry.why
    return None


def applies(default: str, used: set[str] | frozenset[str]) -> bool:
    """Whether a server default that turns on `default` applies to a request whose rows use
    `used`: only where it composes with each."""
    return all(composes(default, other) for other in used)


def unserved(family: dict[str, str], parallel_policy: str | None = None) -> dict[str, str]:
    """The techniques a server does not serve, each with why: those its model's family does not
    (`family`, from `gouache.runner.describe.UNSERVED`), and where every step of its policy
    (`parallel_policy`, as a message names it) runs on several devices, those such a step does
    without."""
    out = dict(family)
    if parallel_policy is not None:
        for name, technique in TECHNIQUES.items():
            if technique.several_devices and name not in out:
                out[name] = (f"every step of {parallel_policy} runs on several devices, where "
                             f"{technique.several_devices}")
    return out


def refused_flag(given: dict[str, bool], family: str, family_unserved: dict[str, str],
                 parallel_policy: str | None = None) -> str | None:
    """Why the first server flag set in `given` (flag -> whether it is set) would be ignored: it
    turns on a technique that a `family` model (`family_unserved`) or a server whose every step
    runs on several devices does not serve; None if none would be."""
    parallel = unserved({}, parallel_policy)
    for name, technique in TECHNIQUES.items():
        for flag in technique.flags:
            if not given.get(flag):
                continue
            if name in family_unserved:
                return f"{flag} would be ignored: {family} models serve no {name} ({family_unserved[name]})"
            if name in parallel:
                return f"{flag} would be ignored: {parallel[name]}"
    return None


def markdown() -> str:
    """The techniques and the pairs' verdicts as docs/architecture.md shows them."""
    lines = ["| technique | asked by | exact | compiled | what |", "| --- | --- | --- | --- | --- |"]
    for t in TECHNIQUES.values():
        compiled = t.compiled or ("yes" if t.compiles else "no: the step runs eagerly")
        lines.append(f"| `{t.name}` | `{t.field}` | {'yes' if t.exact else 'no'} | {compiled} | {t.what} |")
    lines += ["", "| pair | verdict | why |", "| --- | --- | --- |"]
    for p, entry in TABLE.items():
        a, b = (name for name in TECHNIQUES if name in p)
        lines.append(f"| `{a}` + `{b}` | {entry.verdict} | {entry.why} |")
    return "\n".join(lines) + "\n"


def check_row(used: set[str] | frozenset[str]) -> None:
    """Raise ValueError if one request's row of a forward would combine a refused pair (admission
    and the policies keep such a step from being planned: this is the composer's last guard)."""
    refused = refused_pair(used)
    if refused is not None:
        a, b, why = refused
        raise ValueError(f"{a} and {b} do not compose for one request: {why}")

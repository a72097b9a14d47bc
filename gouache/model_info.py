"""What the API needs to know about the served model and how it is served, without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClipRules:
    """What a video model's clips may be."""

    frame_step: int  # frames are 1 + a multiple of this (Wan: 4, its VAE's frames per latent frame)
    max_frames: int  # the most frames a clip may have (the model's RoPE or gouache's bound)
    fps: int  # frames per second when the request names none (the model's training rate)
    from_image: bool = False  # image-to-video: each clip starts from its request's `input_reference`

    def refusal(self, frames: int) -> str | None:
        """Why a clip of `frames` frames is refused (None: it is not)."""
        if not 1 <= frames <= self.max_frames:
            return f"a clip has 1 to {self.max_frames} frames, not {frames}"
        if (frames - 1) % self.frame_step:
            below = frames - (frames - 1) % self.frame_step
            return (f"a clip has 1 + a multiple of {self.frame_step} frames (the model's VAE makes one latent frame "
                    f"of the first and of every {self.frame_step} after it): {below} or {below + self.frame_step}, "
                    f"not {frames}")
        return None

    def frames_of(self, seconds: float, fps: int) -> int:
        """The frames of a clip of `seconds` at `fps`: seconds x fps + 1, to the nearest count it takes."""
        steps = max(round(seconds * fps / self.frame_step), 1)
        return 1 + steps * self.frame_step


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the name clients pass as `model` (built-in name or directory name)
    family: str  # sd | sdxl | sd3 | flux | qwenimage | zimage | flux2 | wan
    size_step: int  # width and height must be multiples of this many pixels
    default_size: int  # pixels per side when the request names no size
    default_steps: int  # num_inference_steps when the request names none
    default_guidance: float  # guidance_scale when the request names none
    uses_cfg: bool  # classifier-free guidance (a negative prompt is meaningful)
    inpaint_channels: bool  # a 9-channel inpainting UNet (masked image as input)
    # (height, width) pixel sizes the server can serve (a clip's (height, width, frames)), when its
    # policy plans with a cost model that prices only the sizes it was profiled at; None: any size
    # the rules above allow
    sizes: tuple[tuple[int, ...], ...] | None = None
    deadlines: bool = False  # the server's policy schedules by `slo_ms`
    tier_slo_ms: tuple[tuple[str, float], ...] = ()  # (service tier, ms): its requests' slo_ms when they send none
    max_batch: int | None = None  # the server's most requests per step (its policy's; measured with auto)
    instruction_edit: bool = False  # an edit without a mask is redrawn as its prompt says (instruction-edit models)
    max_input_images: int = 1  # image[] uploads an edit takes
    generation: bool = True  # makes images from text alone (Qwen-Image-Edit's pipelines need an image)
    min_steps: int = 1  # num_inference_steps the schedule needs at least (Qwen-Image: 2)
    parallel: bool = False  # the server's policy may plan steps on several devices
    # techniques (`gouache.techniques`) the server does not serve, each with why: the model's
    # family's, and where every step runs on several devices, those such a step does without
    unserved: tuple[tuple[str, str], ...] = ()
    cfg_from: float = 1.0  # classifier-free guidance runs for guidance_scale above this (Z-Image: 0)
    token_pixels: int = 16  # pixels per side of one image token: a DiT's patch, a UNet's latent pixel
    clips: ClipRules | None = None  # a video model's (its requests go to /v1/videos); None: it makes images

    @property
    def img2img(self) -> bool:
        """Edits without a mask take `strength` (a 9-channel inpainting UNet takes a mask only; an
        instruction-edit model's edit without a mask follows its prompt)."""
        return not self.inpaint_channels and not self.instruction_edit


    def cfg_rows(self, guidance: float) -> int:
        """Forward rows of a request of `guidance`: 2 with classifier-free guidance."""
        return 2 if self.uses_cfg and guidance > self.cfg_from else 1

    def serves(self, technique: str) -> bool:
        return technique not in dict(self.unserved)


def img2img_start(family: str, steps: int, strength: float) -> int:
    """The step of a `steps`-step schedule where an img2img request of `strength` starts (it
    runs the steps after it), as the family's diffusers Img2Img pipeline counts: UNets run
    int(steps * strength) steps, flow models skip int(steps - steps * strength)."""
    if family in ("sd", "sdxl"):
        return steps - min(int(steps * strength), steps)
    return int(max(steps - steps * strength, 0))


def shown(res: tuple[int, ...]) -> str:
    """A size as requests write it: WxH, or a clip's WxHxF (F frames)."""
    height, width, *frames = res
    return "x".join(map(str, (width, height, *frames)))


def unpriced_message(sizes: tuple[tuple[int, ...], ...], res: tuple[int, ...]) -> str:
    """Why a request of `res` ((h, w), or a clip's (h, w, frames)) is refused by a server whose
    cost model prices only `sizes`."""
    listed = ", ".join(map(shown, sizes))
    return (f"this server's scheduling cost model prices only {listed}, not {shown(res)}; ask for one of "
            f"those sizes (the operator can re-profile with `gouache profile --sizes` to serve others)")

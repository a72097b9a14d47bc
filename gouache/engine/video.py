"""Clips as files: H.264 in MP4 through PyAV (its wheels carry FFmpeg with libx264), and the
first frame as a WebP thumbnail, as OpenAI's videos API serves them. Runs in the codec
processes, like the image encoder."""

from __future__ import annotations

import io

import av
import numpy as np

from gouache.engine.imaging import encode_image

CRF = 18  # x264's constant rate factor: near lossless to the eye (its default is 23)


def encode_video(frames: np.ndarray, fps: int) -> bytes:
    """uint8 [F, H, W, 3] -> MP4 bytes (H.264, yuv420p: even sides, which every model's size step
    gives), one encoder thread: the codec pool runs beside the denoiser."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.thread_count = 1
        stream.options = {"crf": str(CRF)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush
    return buffer.getvalue()


def encode_clip(frames: np.ndarray, fps: int) -> tuple[bytes, bytes]:
    """A clip's MP4 and its first frame's WebP thumbnail."""
    return encode_video(frames, fps), encode_image(frames[0], "webp")

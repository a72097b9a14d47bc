// The Video tab: a video model's clip through the videos API. POST /v1/videos answers at once;
// GET /v1/videos/{id}/events streams its progress and previews; once completed, its MP4 plays
// here (GET /v1/videos/{id}/content, fetched with the key). Cancel deletes it, which stops it. An
// image-to-video model's clip starts from the chosen first frame, sent as a data URL.

import { deleteJson, getBlob, postJson, streamGet } from "./api.js";
import { dataUrl, number, optionalNumbers } from "./form.js";
import { element, showError } from "./results.js";

const KEPT = 4; // finished videos kept on screen

export const VIDEO_FIELDS = [
  { name: "prompt", label: "Prompt", kind: "textarea", rows: 3, wide: true },
  { name: "negative_prompt", label: "Negative prompt", kind: "textarea", rows: 2, wide: true },
  { name: "model", label: "Model", kind: "select" },
  { name: "width", label: "Width" },
  { name: "height", label: "Height" },
  { name: "num_frames", label: "Frames", value: 17, title: "1 + a multiple of the model's frame step" },
  { name: "fps", label: "FPS", placeholder: "model's" },
  { name: "num_inference_steps", label: "Steps" },
  { name: "guidance_scale", label: "Guidance", step: "any" },
  { name: "seed", label: "Seed", placeholder: "random" },
  { name: "partial_images", label: "Previews", value: 2, title: "previews of the first frame while it denoises (0-3)" },
  { name: "input_reference", label: "First frame", kind: "input", file: true, wide: true,
    title: "an image-to-video model's clip starts from it (resized to the clip's size)" },
];

const OPTIONAL = ["fps", "num_inference_steps", "guidance_scale", "seed"];

async function readVideo(form) {
  const f = form.elements;
  const body = {
    prompt: f.prompt.value,
    model: f.model.value,
    size: `${f.width.value}x${f.height.value}`,
    num_frames: number(f.num_frames.value),
    partial_images: number(f.partial_images.value),
  };
  if (f.negative_prompt.value.trim()) body.negative_prompt = f.negative_prompt.value;
  optionalNumbers(body, f, OPTIONAL);
  const [first] = f.input_reference.closest("label").hidden ? [] : f.input_reference.files;
  if (first) body.input_reference = { image_url: await dataUrl(first) }; // OpenAI's reference object
  return body;
}

const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;

class VideoView {
  constructor(container, body) {
    this.started = performance.now();
    this.root = element("article", "request video-request");
    this.summary = element("p", "summary", `${body.num_frames} frames × ${body.size}: waiting for the server…`);
    this.figure = element("figure", "image");
    this.preview = element("img");
    this.preview.alt = "first frame";
    this.progress = element("progress");
    this.caption = element("figcaption", "", "queued");
    const frame = element("div", "frame");
    const [width, height] = body.size.split("x").map(Number);
    this.figure.style.width = `${Math.min(512, Math.max(256, 2 * width))}px`;
    frame.style.aspectRatio = `${width} / ${height}`;
    frame.append(this.preview);
    this.figure.append(frame, this.progress, this.caption);
    this.root.append(this.summary, this.figure);
    container.prepend(this.root);
    for (const old of [...container.children].slice(KEPT)) old.remove();
  }

  event(name, data) {
    const now = seconds(performance.now() - this.started);
    if (name === "video.in_progress") {
      this.progress.max = 100;
      this.progress.value = data.progress;
      this.caption.textContent = `${data.progress} % of the steps`;
      this.figure.dataset.state = "running";
    } else if (name === "video.partial_image") {
      this.preview.src = `data:image/${data.output_format};base64,${data.b64_json}`;
      this.figure.dataset.previews = data.partial_image_index + 1;
    } else if (name === "video.completed") {
      this.progress.value = this.progress.max = 100;
      this.caption.textContent = `seed ${data.seed} · ${data.num_frames} frames at ${data.fps} fps · ${now}`;
    } else if (name === "video.failed") {
      throw new Error(data.error?.message ?? "The video failed.");
    }
    this.summary.textContent = `${data.status ?? "running"} · ${now}`;
  }

  play(blob, data) {
    const video = element("video");
    Object.assign(video, { controls: true, autoplay: true, loop: true, muted: true, playsInline: true });
    video.src = URL.createObjectURL(blob);
    this.preview.replaceWith(video);
    this.figure.dataset.state = "done";
    this.figure.dataset.seed = data.seed;
    const link = element("a", "download", "download");
    link.href = video.src;
    link.download = `gouache-${data.seed}.mp4`;
    this.caption.append(" · ", link);
  }

  end(text, state) {
    this.summary.textContent = text;
    this.root.dataset.state = state;
  }
}

// Wire the tab: submit creates the video and follows it to the end; Cancel deletes it.
export function videoTab(tab, onAuthError) {
  const form = tab.querySelector("form");
  const submit = form.querySelector("button[type=submit]");
  const cancel = form.querySelector(".cancel");
  const errorLine = tab.querySelector(":scope > .error");
  let current = null; // {controller, id} of the video in flight

  cancel.addEventListener("click", () => {
    if (current?.id) deleteJson(`/v1/videos/${current.id}`).catch(() => {});
    current?.controller.abort();
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (current) return; // one video per tab at a time
    current = { controller: new AbortController(), id: null };
    const { signal } = current.controller;
    submit.disabled = true;
    errorLine.hidden = true;
    let view = null;
    try {
      const body = await readVideo(form);
      const made = await postJson("/v1/videos", body, signal);
      current.id = made.id;
      cancel.hidden = false;
      view = new VideoView(tab.querySelector(".results"), body);
      let last = made;
      await streamGet(`/v1/videos/${made.id}/events`, (name, data) => {
        if (!name.endsWith("partial_image")) last = data;
        view.event(name, data);
      }, signal);
      if (last.status !== "completed") throw new Error("The event stream ended before the video was made; try again.");
      view.play(await getBlob(`/v1/videos/${made.id}/content`, signal), last);
      view.end(`${last.num_frames} frames × ${last.size} in ${seconds(performance.now() - view.started)}`, "done");
    } catch (error) {
      if (error.name === "AbortError") {
        view?.end("cancelled", "cancelled");
      } else {
        view?.end("failed", "failed");
        showError(errorLine, error);
        if (error.status === 401) onAuthError(error);
      }
    } finally {
      current.controller.abort();
      current = null;
      submit.disabled = false;
      cancel.hidden = true;
    }
  });
}

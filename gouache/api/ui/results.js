// One tab's image requests: submit, stream (progress, previews, images with seeds and timings),
// cancel, and the API's error message when it refuses.

import { streamImages } from "./api.js";

const KEPT = 6; // finished requests kept on screen per tab

const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

class RequestView {
  constructor(container, body) {
    this.started = performance.now();
    this.total = body.n;
    const [width, height] = String(body.size).split("x").map(Number);
    this.shape = width > 0 && height > 0 ? { width, height } : { width: 1, height: 1 };
    this.root = element("article", "request");
    this.summary = element("p", "summary", `${body.n} × ${body.size}: waiting for the server…`);
    this.images = element("div", "images");
    this.root.append(this.summary, this.images);
    this.figures = new Map();
    container.prepend(this.root);
    for (const old of [...container.children].slice(KEPT)) old.remove();
  }

  figure(index) {
    if (!this.figures.has(index)) {
      const figure = element("figure", "image");
      figure.dataset.index = index;
      const img = element("img");
      img.alt = `image ${index + 1}`;
      const progress = element("progress");
      const frame = element("div", "frame");
      // the image's shape before its first preview: twice its size, within 256-512 px wide
      figure.style.width = `${Math.min(512, Math.max(256, 2 * this.shape.width))}px`;
      frame.style.aspectRatio = `${this.shape.width} / ${this.shape.height}`;
      frame.append(img);
      figure.append(frame, progress, element("figcaption", "", "queued"));
      this.images.append(figure);
      this.figures.set(index, { figure, img, progress, caption: figure.querySelector("figcaption") });
    }
    return this.figures.get(index);
  }

  event(name, data) {
    const view = this.figure(data.index ?? 0);
    if (!this.shown && name !== "gouache.progress") {
      this.shown = true; // the first picture: bring the results into view once
      this.root.scrollIntoView({ block: "nearest" });
    }
    const now = performance.now() - this.started;
    if (name === "gouache.progress") {
      view.firstStep ??= now;
      view.progress.max = data.total_steps;
      view.progress.value = data.step;
      view.caption.textContent = `step ${data.step} / ${data.total_steps}`;
      view.figure.dataset.state = "running";
    } else if (name.endsWith(".partial_image")) {
      view.img.src = `data:image/${data.output_format};base64,${data.b64_json}`;
      view.figure.dataset.previews = data.partial_image_index + 1;
    } else if (name.endsWith(".completed")) {
      view.img.src = `data:image/${data.output_format};base64,${data.b64_json}`;
      view.progress.value = view.progress.max;
      const firstStep = view.firstStep === undefined ? "" : ` (first step at ${seconds(view.firstStep)})`;
      view.caption.textContent = `seed ${data.seed} · ${seconds(now)}${firstStep}`;
      view.figure.dataset.state = "done";
      view.figure.dataset.seed = data.seed;
      const link = element("a", "download", "download");
      link.href = view.img.src;
      link.download = `gouache-${data.seed}.${data.output_format}`;
      view.caption.append(" · ", link);
    }
    const done = [...this.figures.values()].filter((v) => v.figure.dataset.state === "done").length;
    this.summary.textContent = `${done} of ${this.total} done · ${seconds(now)}`;
  }

  end(text, state) {
    this.summary.textContent = text;
    this.root.dataset.state = state;
  }
}

// Wire a tab: its form's submit runs `makeRequest()` -> [path, body] (body: JSON object or
// FormData) and shows what streams back; Cancel aborts it.
export function imageTab(tab, makeRequest, onAuthError) {
  const form = tab.querySelector("form");
  const submit = form.querySelector("button[type=submit]");
  const cancel = form.querySelector(".cancel");
  const errorLine = tab.querySelector(":scope > .error");
  let controller = null;

  cancel.addEventListener("click", () => controller?.abort());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    errorLine.hidden = true;
    let request;
    try {
      request = await makeRequest();
    } catch (error) {
      showError(errorLine, error);
      return;
    }
    const [path, body, described] = request;
    controller = new AbortController();
    submit.disabled = true;
    cancel.hidden = false;
    const view = new RequestView(tab.querySelector(".results"), described);
    try {
      await streamImages(path, body, (name, data) => view.event(name, data), controller.signal);
      view.end(`${view.total} × ${described.size} in ${seconds(performance.now() - view.started)}`, "done");
    } catch (error) {
      if (error.name === "AbortError") {
        view.end("cancelled", "cancelled");
      } else {
        if (view.figures.size) view.end("failed", "failed");
        else view.root.remove();
        showError(errorLine, error);
        if (error.status === 401) onAuthError(error);
      }
    } finally {
      submit.disabled = false;
      cancel.hidden = true;
      controller = null;
    }
  });
}

export function showError(line, error) {
  line.textContent = error.message;
  line.hidden = false;
}

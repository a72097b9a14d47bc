// One tab's image requests: submit, stream (progress, previews, images with seeds and timings),
// cancel, and the API's error message when it refuses.

import { streamImages } from "./api.js";

const KEPT = 6; // finished requests kept on screen per tab
const MAX_SHOWN = 64; // places made ahead for a request's images

const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;

export function element(tag, className, text) {
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
    // a place for each image in order, whichever starts first (a refused `n` gets none)
    const n = Number(body.n);
    for (let index = 0; Number.isInteger(n) && index < Math.min(n, MAX_SHOWN); index++) this.figure(index);
  }

  get done() {
    return [...this.figures.values()].filter((view) => view.figure.dataset.state === "done").length;
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
    if (!this.shown && !name.startsWith("gouache.")) {
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
    } else if (name === "gouache.paused") {
      view.caption.textContent = `paused at step ${data.step} / ${data.total_steps} for a higher tier`;
      view.figure.dataset.state = "paused";
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
    this.summary.textContent = `${this.done} of ${this.total} done · ${seconds(now)}`;
  }

  end(text, state) {
    this.summary.textContent = text;
    this.root.dataset.state = state;
  }
}

// Wire a tab: its form's submit runs `makeRequest()` -> [path, body, params] (body: JSON object
// or FormData; params: the fields as sent) and shows what streams back; Cancel aborts it.
export function imageTab(tab, makeRequest, onAuthError) {
  const form = tab.querySelector("form");
  const submit = form.querySelector("button[type=submit]");
  const cancel = form.querySelector(".cancel");
  const errorLine = tab.querySelector(":scope > .error");
  let current = null; // the AbortController of the request in flight

  cancel.addEventListener("click", () => current?.abort());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (current) return; // one request per tab at a time
    const controller = (current = new AbortController());
    submit.disabled = true;
    errorLine.hidden = true;
    let view = null;
    try {
      const [path, body, params] = await makeRequest();
      cancel.hidden = false;
      view = new RequestView(tab.querySelector(".results"), params);
      await streamImages(path, body, (name, data) => view.event(name, data), controller.signal);
      if (view.done < view.total) throw new Error("The stream ended before every image arrived; try again.");
      view.end(`${view.total} × ${params.size} in ${seconds(performance.now() - view.started)}`, "done");
    } catch (error) {
      if (error.name === "AbortError") {
        view?.end("cancelled", "cancelled");
      } else {
        if (view?.done) view.end("failed", "failed");
        else view?.root.remove();
        showError(errorLine, error);
        if (error.status === 401) onAuthError(error);
      }
    } finally {
      controller.abort(); // ends the request on the server unless it finished
      current = null;
      submit.disabled = false;
      cancel.hidden = true;
    }
  });
}

export function showError(line, error) {
  line.textContent = error.message;
  line.hidden = false;
}

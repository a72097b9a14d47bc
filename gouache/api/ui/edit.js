// The edit tab's picture and mask: upload an image, paint the region to repaint with a brush
// (the eraser takes paint away), and send both to /v1/images/edits. The mask sent is OpenAI's
// kind: a PNG of the image's size, fully transparent where painted (repainted) and opaque
// elsewhere (kept, pixel for pixel). With nothing painted it is transparent everywhere: the
// whole image is repainted. (No mask at all would let the upload's own alpha decide, and an
// RGBA upload would then repaint only its transparent pixels, often none.)

const PAINT = "rgb(255, 45, 111)"; // shown at half opacity over the picture (style.css)
const VIEW = 384; // the picture is shown within a VIEW x VIEW box

export class MaskPainter {
  constructor(form) {
    this.wrap = form.querySelector(".canvas-wrap");
    this.picture = form.querySelector("canvas.picture");
    this.mask = form.querySelector("canvas.mask");
    this.brush = form.elements.brush;
    this.tool = "brush";
    this.file = null;
    this.last = null; // the stroke's previous point while the pointer is down
    for (const button of form.querySelectorAll("[data-tool]")) {
      button.addEventListener("click", () => this.use(button.dataset.tool, form));
    }
    form.querySelector(".clear-mask").addEventListener("click", () => this.clear());
    this.mask.addEventListener("pointerdown", (event) => {
      this.mask.setPointerCapture(event.pointerId);
      this.last = this.point(event);
      this.stroke(this.last, this.last);
    });
    this.mask.addEventListener("pointermove", (event) => {
      if (this.last === null) return;
      const point = this.point(event);
      this.stroke(this.last, point);
      this.last = point;
    });
    for (const end of ["pointerup", "pointercancel"]) this.mask.addEventListener(end, () => (this.last = null));
  }

  use(tool, form) {
    this.tool = tool;
    for (const button of form.querySelectorAll("[data-tool]")) button.setAttribute("aria-pressed", button.dataset.tool === tool);
  }

  // Show `file` and clear the mask; rejects (and holds no image) when the browser cannot decode it.
  async load(file) {
    this.file = null;
    this.wrap.hidden = true;
    const bitmap = await createImageBitmap(file);
    for (const canvas of [this.picture, this.mask]) {
      canvas.width = bitmap.width;
      canvas.height = bitmap.height;
    }
    this.picture.getContext("2d").drawImage(bitmap, 0, 0);
    this.wrap.style.width = `${Math.round(VIEW * Math.min(1, bitmap.width / bitmap.height))}px`;
    this.file = file;
    this.wrap.hidden = false;
    return { width: bitmap.width, height: bitmap.height };
  }

  clear() {
    this.mask.getContext("2d").clearRect(0, 0, this.mask.width, this.mask.height);
  }

  // A pointer event's position in image pixels (the canvas is shown scaled).
  point(event) {
    const rect = this.mask.getBoundingClientRect();
    return [(event.clientX - rect.left) * (this.mask.width / rect.width), (event.clientY - rect.top) * (this.mask.height / rect.height)];
  }

  stroke([x0, y0], [x1, y1]) {
    const ctx = this.mask.getContext("2d");
    ctx.globalCompositeOperation = this.tool === "eraser" ? "destination-out" : "source-over";
    ctx.strokeStyle = PAINT;
    ctx.lineWidth = Number(this.brush.value) * (this.mask.width / this.mask.getBoundingClientRect().width);
    ctx.lineCap = ctx.lineJoin = "round";
    ctx.beginPath();
    ctx.moveTo(x0, y0);
    ctx.lineTo(x1, y1);
    ctx.stroke();
  }

  // Whether any pixel is painted (at least half covered).
  painted() {
    const { width, height } = this.mask;
    return this.mask.getContext("2d").getImageData(0, 0, width, height).data.some((value, i) => i % 4 === 3 && value >= 128);
  }

  // The mask PNG to send. A pixel is repainted where the paint covers at least half of it; with
  // nothing painted, every pixel is.
  async maskBlob() {
    const { width, height } = this.mask;
    const paint = this.mask.getContext("2d").getImageData(0, 0, width, height).data;
    const mask = new ImageData(width, height); // transparent black
    const painted = this.painted();
    for (let i = 3; painted && i < paint.length; i += 4) mask.data[i] = paint[i] >= 128 ? 0 : 255;
    const canvas = document.createElement("canvas");
    canvas.width = width;
    canvas.height = height;
    canvas.getContext("2d").putImageData(mask, 0, 0);
    return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
  }
}

// The multipart body of an edit: the upload as it was chosen, any further images (`image[]`, for
// models that edit several), the mask, the shared fields (the adapter lists as JSON text). With
// nothing painted, an instruction-edit model's edit (it follows the prompt) and an edit with a
// strength (img2img) go without a mask; a strength with paint goes with the mask, for the API to
// say which to drop.
export async function editForm(painter, params, instructionEdit, references = []) {
  const form = new FormData();
  if (painter.file) {
    form.append("image", painter.file, painter.file.name);
    for (const file of references) form.append("image[]", file, file.name);
    const maskless = (instructionEdit || params.strength !== undefined) && !painter.painted();
    if (!maskless) form.append("mask", await painter.maskBlob(), "mask.png");
  }
  for (const [name, value] of Object.entries(params)) form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
  return form;
}
